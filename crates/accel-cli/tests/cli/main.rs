//! The one integration test binary of accel-cli (each test binary links candle, so one binary builds fastest):
//! `binary` runs the `accel` command end to end, `config_file` exercises the config-file parser and launch plan.

mod binary;
mod config_file;
