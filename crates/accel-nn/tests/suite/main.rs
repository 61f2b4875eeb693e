//! One integration-test binary for the crate (each test binary links candle: one link instead of one per file).

mod nn_activation;
mod nn_attention;
mod nn_autocast;
mod nn_check;
mod nn_cross_entropy;
mod nn_layer_norm;
mod nn_linear;
mod nn_softmax;
mod optim;
