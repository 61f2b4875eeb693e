//! store protocol (to be written)
