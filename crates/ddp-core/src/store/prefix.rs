//! store prefix (to be written)
/// A namespaced view of a store.
pub struct PrefixStore {}
