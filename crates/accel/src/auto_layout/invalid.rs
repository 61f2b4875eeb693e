//! [`InvalidSpec`]: an input of the cost model (the model, the machines, the training) that cannot be costed — a
//! size of 0, a link without bandwidth, a parameter count below what the shapes give. Its own leaf module: the
//! inputs' checks return it without reading the chooser's error, which holds costed layouts.

/// An input that cannot be costed, and why (the chooser's [`super::AutoLayoutError::InvalidSpec`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidSpec(pub String);

impl std::fmt::Display for InvalidSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "auto layout: {}", self.0)
    }
}

impl std::error::Error for InvalidSpec {}

impl From<InvalidSpec> for super::AutoLayoutError {
    fn from(e: InvalidSpec) -> Self {
        super::AutoLayoutError::InvalidSpec(e.0)
    }
}

/// The Accelerator's error, as for any [`super::AutoLayoutError`].
impl From<InvalidSpec> for crate::AccelError {
    fn from(e: InvalidSpec) -> Self {
        super::AutoLayoutError::from(e).into()
    }
}
