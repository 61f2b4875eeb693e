//! Models written once on [`crate::nn`]'s builder, each with its default parallel plan and its checkpoint format:
//! what a user brings as a Hugging Face checkpoint, laid out at any data × tensor × pipeline layout.

pub mod llama;
