//! Numeric CSV files as a [`TensorDataset`]: every column is a number, one of them is the label.
//!
//! Deliberately small: comma (or another one-byte) separated numbers, an optional header line, fields optionally
//! wrapped in double quotes, `.gz` files decompressed on the fly, blank lines ignored. No quoted separators or
//! multi-line fields — numeric data does not need them. Every error names the file, the 1-based line and column.

use std::io::Read;
use std::path::Path;

use candle_core::{Device, Tensor};

use super::dataset::TensorDataset;
use crate::error::{AccelError, Result};

/// Which column holds the label.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum LabelColumn {
    /// The last column (e.g. scikit-learn's `digits.csv`).
    #[default]
    Last,
    /// The column at this 0-based index.
    Index(usize),
    /// The column with this header name (needs a header line).
    Name(String),
}

/// How the label is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LabelKind {
    /// Class ids: non-negative integers, targets `[N]` u32.
    #[default]
    Class,
    /// Real values (regression), targets `[N]` f32.
    Value,
}

/// Options of [`read_csv`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CsvOptions {
    /// `Some(true)`: the first line is a header; `Some(false)`: it is data; `None` (default): it is a header when
    /// any of its fields is not a number.
    pub has_header: Option<bool>,
    /// Field separator (default `b','`).
    pub delimiter: u8,
    /// The label column (default the last).
    pub label: LabelColumn,
    /// Class ids or real values (default class ids).
    pub label_kind: LabelKind,
}

impl Default for CsvOptions {
    fn default() -> Self {
        CsvOptions { has_header: None, delimiter: b',', label: LabelColumn::Last, label_kind: LabelKind::Class }
    }
}

/// Reads a numeric CSV file (`.gz` too): inputs `[N, columns − 1]` f32 (all columns but the label, in file
/// order), targets `[N]` u32 (class ids) or f32 (values), on the CPU.
///
/// Errors (naming `file:line:column`): unreadable file, a field that is not a number, a row with a different
/// number of columns than the first, a label that is not a class id, a label column that does not exist, no data.
pub fn read_csv(path: &Path, opts: &CsvOptions) -> Result<TensorDataset> {
    let file =
        std::fs::File::open(path).map_err(|e| AccelError::io(format!("opening CSV file {}", path.display()), e))?;
    let mut text = String::new();
    if path.extension().is_some_and(|e| e == "gz") {
        flate2::read::GzDecoder::new(file).read_to_string(&mut text)
    } else {
        std::io::BufReader::new(file).read_to_string(&mut text)
    }
    .map_err(|e| AccelError::io(format!("reading CSV file {}", path.display()), e))?;
    parse_csv(&text, &path.display().to_string(), opts)
}

/// Parses CSV text; `name` (a file name) prefixes error messages.
pub fn parse_csv(text: &str, name: &str, opts: &CsvOptions) -> Result<TensorDataset> {
    let delim = char::from(opts.delimiter);
    let mut lines =
        text.lines().enumerate().map(|(i, l)| (i + 1, l.trim_end_matches('\r'))).filter(|(_, l)| !l.trim().is_empty());
    let Some((first_no, first)) = lines.next() else {
        return Err(AccelError::Data(format!("{name}: the CSV file has no rows")));
    };
    let first_fields: Vec<&str> = first.split(delim).map(clean).collect();
    let header = match opts.has_header {
        Some(h) => h,
        None => first_fields.iter().any(|f| f.parse::<f64>().is_err()),
    };
    let columns = first_fields.len();
    let label = match &opts.label {
        LabelColumn::Last => columns - 1,
        LabelColumn::Index(i) if *i < columns => *i,
        LabelColumn::Index(i) => {
            return Err(AccelError::Data(format!(
            "{name}:{first_no}: label column index {i} does not exist (the file has {columns} columns, 0..{columns})"
        )))
        }
        LabelColumn::Name(wanted) => {
            if !header {
                return Err(AccelError::Data(format!(
                    "{name}: label column {wanted:?} asked by name, but the file has no header line; give the label \
                     column by index"
                )));
            }
            first_fields.iter().position(|f| f == wanted).ok_or_else(|| {
                AccelError::Data(format!(
                    "{name}:{first_no}: no column named {wanted:?} in the header {first_fields:?}"
                ))
            })?
        }
    };
    if columns < 2 {
        return Err(AccelError::Data(format!(
            "{name}:{first_no}: a data set needs at least two columns (features and a label), found {columns}"
        )));
    }
    let col_name = |c: usize| -> String {
        if header {
            format!("{} ({:?})", c + 1, first_fields[c])
        } else {
            (c + 1).to_string()
        }
    };

    let data_lines: Box<dyn Iterator<Item = (usize, &str)>> =
        if header { Box::new(lines) } else { Box::new(std::iter::once((first_no, first)).chain(lines)) };
    let mut features: Vec<f32> = Vec::new();
    let mut labels_u32: Vec<u32> = Vec::new();
    let mut labels_f32: Vec<f32> = Vec::new();
    let mut rows = 0usize;
    for (line_no, line) in data_lines {
        let fields: Vec<&str> = line.split(delim).map(clean).collect();
        if fields.len() != columns {
            return Err(AccelError::Data(format!(
                "{name}:{line_no}: expected {columns} columns (as on line {first_no}), found {}",
                fields.len()
            )));
        }
        for (c, field) in fields.iter().enumerate() {
            let v: f64 = field.parse().map_err(|_| {
                AccelError::Data(format!("{name}:{line_no}:{}: cannot parse {field:?} as a number", col_name(c)))
            })?;
            if c != label {
                features.push(v as f32);
            } else {
                match opts.label_kind {
                    LabelKind::Value => labels_f32.push(v as f32),
                    LabelKind::Class => {
                        if v < 0.0 || v.fract() != 0.0 || v > f64::from(u32::MAX) {
                            return Err(AccelError::Data(format!(
                                "{name}:{line_no}:{}: label {field:?} is not a class id (a non-negative integer); \
                                 read it with LabelKind::Value for regression",
                                col_name(c)
                            )));
                        }
                        labels_u32.push(v as u32);
                    }
                }
            }
        }
        rows += 1;
    }
    if rows == 0 {
        return Err(AccelError::Data(format!("{name}: the CSV file has a header but no data rows")));
    }
    let inputs = Tensor::from_vec(features, (rows, columns - 1), &Device::Cpu)?;
    let targets = match opts.label_kind {
        LabelKind::Class => Tensor::from_vec(labels_u32, rows, &Device::Cpu)?,
        LabelKind::Value => Tensor::from_vec(labels_f32, rows, &Device::Cpu)?,
    };
    TensorDataset::new(inputs, targets)
}

/// A field without surrounding blanks and double quotes.
fn clean(field: &str) -> &str {
    let f = field.trim();
    f.strip_prefix('"').and_then(|f| f.strip_suffix('"')).map(str::trim).unwrap_or(f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Dataset;

    #[test]
    fn header_auto_detected_and_label_by_name() {
        let text = "a,label,b\n1,0,2\n\"3\", 2 ,4.5\n";
        let opts = CsvOptions { label: LabelColumn::Name("label".into()), ..Default::default() };
        let ds = parse_csv(text, "t.csv", &opts).unwrap();
        assert_eq!(ds.len(), 2);
        assert_eq!(ds.inputs().to_vec2::<f32>().unwrap(), vec![vec![1., 2.], vec![3., 4.5]]);
        assert_eq!(ds.targets().to_vec1::<u32>().unwrap(), vec![0, 2]);
    }

    #[test]
    fn errors_name_file_line_and_column() {
        let err = parse_csv("x,y\n1,2\n3,oops\n", "f.csv", &CsvOptions::default()).unwrap_err().to_string();
        assert!(err.contains("f.csv:3:2 (\"y\")") && err.contains("\"oops\""), "{err}");
        let err = parse_csv("1,2\n3,4,5\n", "g.csv", &CsvOptions::default()).unwrap_err().to_string();
        assert!(err.contains("g.csv:2") && err.contains("expected 2 columns"), "{err}");
        let err = parse_csv("1,2\n3,1.5\n", "h.csv", &CsvOptions::default()).unwrap_err().to_string();
        assert!(err.contains("h.csv:2:2") && err.contains("not a class id"), "{err}");
        let opts = CsvOptions { label: LabelColumn::Name("y".into()), has_header: Some(false), ..Default::default() };
        assert!(parse_csv("1,2\n", "i.csv", &opts).unwrap_err().to_string().contains("no header"));
    }

    #[test]
    fn reads_the_shipped_digits_file() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/digits/digits.csv.gz");
        let ds = read_csv(&path, &CsvOptions::default()).unwrap();
        assert_eq!(ds.inputs().dims(), &[1797, 64]);
        let labels = ds.targets().to_vec1::<u32>().unwrap();
        // scikit-learn's digits start 0, 1, 2, ... and class 0 has 178 samples.
        assert_eq!(&labels[..3], &[0, 1, 2]);
        assert_eq!(labels.iter().filter(|&&l| l == 0).count(), 178);
    }
}
