//! store server (to be written)
/// The store server.
pub struct TcpStoreServer {}
