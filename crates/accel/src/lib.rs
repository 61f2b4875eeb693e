//! accel — level 2 (placeholder; see issue 3).
pub mod data {
    //! Data sets and loaders.
    pub mod idx;
}
