//! Reader for the IDX format of MNIST (LeCun et al., <http://yann.lecun.com/exdb/mnist/>), plain or gzip.
//!
//! Layout: magic `0x00 0x00 <type> <ndims>`, then `ndims` big-endian u32 dimensions, then the data row-major.
//! Only unsigned-byte data (type `0x08`, what MNIST uses) is supported; anything else is an error naming the file.

use std::io::Read;
use std::path::Path;

/// An unsigned-byte IDX array.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxArray {
    /// Dimensions, e.g. `[10000, 28, 28]` for images, `[10000]` for labels.
    pub dims: Vec<usize>,
    /// `dims.iter().product()` bytes, row-major.
    pub data: Vec<u8>,
}

/// Reads an IDX file; a name ending in `.gz` is decompressed on the fly.
///
/// Errors (`io::ErrorKind::InvalidData`) name the file and what is wrong: bad magic, unsupported type,
/// truncated data.
pub fn read_idx(path: &Path) -> std::io::Result<IdxArray> {
    let file = std::fs::File::open(path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot open IDX file {}: {e}", path.display())))?;
    let mut bytes = Vec::new();
    if path.extension().is_some_and(|e| e == "gz") {
        flate2::read::GzDecoder::new(file).read_to_end(&mut bytes)
    } else {
        std::io::BufReader::new(file).read_to_end(&mut bytes)
    }
    .map_err(|e| std::io::Error::new(e.kind(), format!("cannot read IDX file {}: {e}", path.display())))?;
    parse_idx(&bytes)
        .map_err(|msg| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {msg}", path.display())))
}

/// Parses IDX bytes (already decompressed).
pub fn parse_idx(bytes: &[u8]) -> Result<IdxArray, String> {
    if bytes.len() < 4 || bytes[0] != 0 || bytes[1] != 0 {
        return Err("not an IDX file (magic must start with two zero bytes)".into());
    }
    if bytes[2] != 0x08 {
        return Err(format!("IDX element type 0x{:02x} is not supported (only unsigned bytes, 0x08)", bytes[2]));
    }
    let ndims = bytes[3] as usize;
    let header = 4 + 4 * ndims;
    if bytes.len() < header {
        return Err(format!("truncated header: {ndims} dimensions need {header} bytes, file has {}", bytes.len()));
    }
    let dims: Vec<usize> =
        (0..ndims).map(|i| u32::from_be_bytes(bytes[4 + 4 * i..8 + 4 * i].try_into().unwrap()) as usize).collect();
    let n: usize = dims.iter().product();
    if bytes.len() - header != n {
        return Err(format!("dimensions {dims:?} need {n} data bytes, file has {}", bytes.len() - header));
    }
    Ok(IdxArray { dims, data: bytes[header..].to_vec() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_header_and_rejects_truncation() {
        let mut b = vec![0, 0, 8, 2, 0, 0, 0, 2, 0, 0, 0, 3];
        b.extend([1, 2, 3, 4, 5, 6]);
        let a = parse_idx(&b).unwrap();
        assert_eq!(a.dims, vec![2, 3]);
        assert_eq!(a.data, vec![1, 2, 3, 4, 5, 6]);
        b.pop();
        assert!(parse_idx(&b).unwrap_err().contains("need 6 data bytes"));
    }

    #[test]
    fn reads_the_shipped_mnist_test_labels() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/mnist/t10k-labels-idx1-ubyte.gz");
        let a = read_idx(&path).unwrap();
        assert_eq!(a.dims, vec![10000]);
        // The first MNIST test labels are 7, 2, 1, 0, 4.
        assert_eq!(&a.data[..5], &[7, 2, 1, 0, 4]);
    }
}
