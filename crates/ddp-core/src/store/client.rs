//! store client (to be written)
/// Client of a [`super::TcpStoreServer`].
pub struct TcpStore {}
