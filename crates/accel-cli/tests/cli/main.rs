//! The one integration test binary of accel-cli (each test binary links candle, so one binary builds fastest):
//! `binary` runs the `accel` command end to end, `config_file` exercises the config-file parser and launch plan,
//! `guide_path` runs the commands of docs/guide/cli.md's "The path: config, test, launch".

mod binary;
mod config_file;
mod guide_path;
