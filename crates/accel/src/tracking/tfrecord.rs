//! TFRecord framing, the container of TensorBoard event files.
//!
//! Each record is `u64 length (little-endian) | u32 masked_crc32c(length bytes) | data | u32 masked_crc32c(data)`,
//! where `masked_crc32c(x) = rotate_right(crc32c(x), 15) + 0xa282ead8` (wrapping). Reference: TensorFlow's
//! `tensorflow/core/lib/io/record_writer.cc` and `tsl/lib/hash/crc32c.h` (`Mask`). CRC32C is the Castagnoli CRC
//! (the `crc32c` crate, hardware-accelerated where available).

use std::io::{self, Write};

/// The constant TensorFlow adds to a rotated CRC ("mask delta").
pub const MASK_DELTA: u32 = 0xa282_ead8;

/// TensorFlow's masked CRC32C of `data`: `((crc >> 15) | (crc << 17)) + 0xa282ead8`.
///
/// Masking keeps a CRC computed over bytes that themselves contain CRCs from being degenerate.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    crc32c::crc32c(data).rotate_right(15).wrapping_add(MASK_DELTA)
}

/// Writes one record (`data` framed with its length and both CRCs); 16 bytes of overhead.
pub fn write_record(w: &mut impl Write, data: &[u8]) -> io::Result<()> {
    let len = (data.len() as u64).to_le_bytes();
    w.write_all(&len)?;
    w.write_all(&masked_crc32c(&len).to_le_bytes())?;
    w.write_all(data)?;
    w.write_all(&masked_crc32c(data).to_le_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::manual_rotate)] // the mask written out as TensorFlow's crc32c.h spells it
    fn crc32c_check_value_and_mask() {
        // The CRC-32C check value of "123456789" is 0xE3069283 (RFC 3720, appendix B.4).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        let crc = 0xE306_9283u32;
        assert_eq!(masked_crc32c(b"123456789"), ((crc >> 15) | (crc << 17)).wrapping_add(0xa282_ead8));
    }

    #[test]
    fn record_layout() {
        let mut buf = Vec::new();
        write_record(&mut buf, b"abc").unwrap();
        assert_eq!(buf.len(), 8 + 4 + 3 + 4);
        assert_eq!(&buf[..8], &3u64.to_le_bytes());
        assert_eq!(&buf[8..12], &masked_crc32c(&3u64.to_le_bytes()).to_le_bytes());
        assert_eq!(&buf[12..15], b"abc");
        assert_eq!(&buf[15..], &masked_crc32c(b"abc").to_le_bytes());
    }
}
