//! MNIST from IDX files (LeCun et al. 1998, <http://yann.lecun.com/exdb/mnist/>) as a [`TensorDataset`].

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use super::dataset::TensorDataset;
use super::idx::read_idx;
use crate::error::{AccelError, Result};

/// Pixels per MNIST image (28 × 28).
pub const MNIST_PIXELS: usize = 28 * 28;
/// Number of MNIST classes (digits 0–9).
pub const MNIST_CLASSES: usize = 10;

/// Loads the split `split` of MNIST from `dir`: `{split}-images-idx3-ubyte[.gz]` and
/// `{split}-labels-idx1-ubyte[.gz]` (the repository ships `train10k`, the first 10 000 training images, and
/// `t10k`, the test set, in `data/mnist`).
///
/// Returns inputs `[N, 784]` f32 scaled to `[0, 1]` (byte / 255) and targets `[N]` u32 (digits 0–9), on the CPU.
/// Errors name the missing or malformed file, or the mismatch between image and label counts.
pub fn load_mnist(dir: &Path, split: &str) -> Result<TensorDataset> {
    let images_path = idx_path(dir, split, "images-idx3-ubyte")?;
    let labels_path = idx_path(dir, split, "labels-idx1-ubyte")?;
    let images = read_idx(&images_path).map_err(|e| AccelError::io("reading MNIST images", e))?;
    let labels = read_idx(&labels_path).map_err(|e| AccelError::io("reading MNIST labels", e))?;
    if images.dims.len() != 3 || images.dims[1] * images.dims[2] != MNIST_PIXELS {
        return Err(AccelError::Data(format!(
            "{}: MNIST images have dims {:?}, expected [n, 28, 28]",
            images_path.display(),
            images.dims
        )));
    }
    if labels.dims.len() != 1 || labels.dims[0] != images.dims[0] {
        return Err(AccelError::Data(format!(
            "{}: {:?} labels for {} images in {}",
            labels_path.display(),
            labels.dims,
            images.dims[0],
            images_path.display()
        )));
    }
    if let Some(pos) = labels.data.iter().position(|&l| l as usize >= MNIST_CLASSES) {
        return Err(AccelError::Data(format!(
            "{}: label {pos} is {}, expected a digit 0-9",
            labels_path.display(),
            labels.data[pos]
        )));
    }
    let n = images.dims[0];
    let pixels: Vec<f32> = images.data.iter().map(|&b| f32::from(b) / 255.0).collect();
    let digits: Vec<u32> = labels.data.iter().map(|&l| u32::from(l)).collect();
    TensorDataset::new(
        Tensor::from_vec(pixels, (n, MNIST_PIXELS), &Device::Cpu)?,
        Tensor::from_vec(digits, n, &Device::Cpu)?,
    )
}

/// `{dir}/{split}-{stem}.gz`, or the uncompressed file when only that exists.
fn idx_path(dir: &Path, split: &str, stem: &str) -> Result<PathBuf> {
    let gz = dir.join(format!("{split}-{stem}.gz"));
    let plain = dir.join(format!("{split}-{stem}"));
    if gz.is_file() {
        Ok(gz)
    } else if plain.is_file() {
        Ok(plain)
    } else if !dir.is_dir() {
        Err(AccelError::Data(format!(
            "MNIST directory {} does not exist (expected it to hold {split}-images-idx3-ubyte[.gz] and \
             {split}-labels-idx1-ubyte[.gz]; the repository ships train10k and t10k in data/mnist)",
            dir.display()
        )))
    } else {
        Err(AccelError::Data(format!(
            "MNIST split {split:?}: searched {} for {split}-{stem}[.gz] and found neither {} nor {} (the \
             repository ships train10k and t10k in data/mnist)",
            dir.display(),
            gz.file_name().unwrap_or_default().to_string_lossy(),
            plain.file_name().unwrap_or_default().to_string_lossy()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Dataset;

    fn data_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/mnist")
    }

    #[test]
    fn loads_the_shipped_test_split() {
        let ds = load_mnist(&data_dir(), "t10k").unwrap();
        assert_eq!(ds.len(), 10_000);
        assert_eq!(ds.inputs().dims(), &[10_000, 784]);
        let b = ds.get_batch(&[0, 1, 2, 3, 4]).unwrap();
        assert_eq!(b.targets.to_vec1::<u32>().unwrap(), vec![7, 2, 1, 0, 4]);
        let px = b.inputs.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(px.iter().all(|&p| (0.0..=1.0).contains(&p)));
        assert!(px.contains(&1.0));
    }

    #[test]
    fn missing_split_names_the_files() {
        let err = load_mnist(&data_dir(), "train60k").unwrap_err().to_string();
        assert!(err.contains("train60k-images-idx3-ubyte.gz") && err.contains("train10k"), "{err}");
        assert!(err.contains(&data_dir().display().to_string()), "names the directory searched: {err}");
    }

    #[test]
    fn missing_directory_is_named_without_blaming_a_flag() {
        let err = load_mnist(Path::new("/nonexistent/mnist"), "t10k").unwrap_err().to_string();
        assert!(err.contains("/nonexistent/mnist does not exist"), "{err}");
        assert!(err.contains("t10k-images-idx3-ubyte[.gz]") && err.contains("t10k-labels-idx1-ubyte[.gz]"), "{err}");
        assert!(!err.contains("pass --"), "{err}");
    }
}
