//! The parameter fingerprint DDP compares across ranks at construction: names, shapes and dtypes, in
//! registration order (PyTorch's `_verify_param_shape_across_processes` checks shapes; names and dtypes are
//! compared too because a silent reorder or a dtype mismatch would mis-reduce just as badly).

use crate::{DdpError, ProcessGroup, Result};

/// One parameter as every rank must agree on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ParamSig {
    pub name: String,
    pub dims: Vec<usize>,
    pub dtype: String,
}

impl std::fmt::Display for ParamSig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` {:?} {}", self.name, self.dims, self.dtype)
    }
}

/// Length-prefixed little-endian encoding: count, then per parameter name, dims, dtype.
pub(crate) fn encode(sigs: &[ParamSig]) -> Vec<u8> {
    let mut out = Vec::new();
    let put = |out: &mut Vec<u8>, v: u64| out.extend_from_slice(&v.to_le_bytes());
    put(&mut out, sigs.len() as u64);
    for s in sigs {
        put(&mut out, s.name.len() as u64);
        out.extend_from_slice(s.name.as_bytes());
        put(&mut out, s.dims.len() as u64);
        for &d in &s.dims {
            put(&mut out, d as u64);
        }
        put(&mut out, s.dtype.len() as u64);
        out.extend_from_slice(s.dtype.as_bytes());
    }
    out
}

/// Inverse of [`encode`]; `None` on malformed bytes.
pub(crate) fn decode(bytes: &[u8]) -> Option<Vec<ParamSig>> {
    struct Reader<'a>(&'a [u8]);
    impl<'a> Reader<'a> {
        fn take(&mut self, n: usize) -> Option<&'a [u8]> {
            if n > self.0.len() {
                return None;
            }
            let (head, tail) = self.0.split_at(n);
            self.0 = tail;
            Some(head)
        }
        fn u64(&mut self) -> Option<usize> {
            usize::try_from(u64::from_le_bytes(self.take(8)?.try_into().ok()?)).ok()
        }
        fn string(&mut self) -> Option<String> {
            let n = self.u64()?;
            String::from_utf8(self.take(n)?.to_vec()).ok()
        }
    }
    let mut r = Reader(bytes);
    let count = r.u64()?;
    let mut sigs = Vec::with_capacity(count.min(1 << 16));
    for _ in 0..count {
        let name = r.string()?;
        let nd = r.u64()?;
        let dims = (0..nd).map(|_| r.u64()).collect::<Option<Vec<_>>>()?;
        let dtype = r.string()?;
        sigs.push(ParamSig { name, dims, dtype });
    }
    r.0.is_empty().then_some(sigs)
}

/// All-gathers every rank's fingerprint (two collectives: the lengths, then the padded bytes) and fails with
/// [`DdpError::ParameterMismatch`] on every rank alike when any rank differs from rank 0.
pub(crate) fn check_across_ranks(pg: &ProcessGroup, sigs: &[ParamSig]) -> Result<()> {
    let world = pg.world_size();
    if world == 1 {
        return Ok(());
    }
    let mine = encode(sigs);
    let mut lens = vec![0i64; world];
    pg.all_gather(&[mine.len() as i64], &mut lens)?;
    let max = lens.iter().copied().max().unwrap_or(0) as usize;
    let mut padded = mine.clone();
    padded.resize(max, 0);
    let mut all = vec![0u8; max * world];
    pg.all_gather(&padded, &mut all)?;
    let per_rank: Vec<Vec<ParamSig>> = (0..world)
        .map(|r| {
            decode(&all[r * max..r * max + lens[r] as usize]).ok_or_else(|| {
                DdpError::Protocol(format!("DDP parameter fingerprint from rank {r} is malformed (mixed versions?)"))
            })
        })
        .collect::<Result<_>>()?;
    match first_mismatch(&per_rank) {
        None => Ok(()),
        Some(msg) => Err(DdpError::ParameterMismatch(msg)),
    }
}

/// Describes the first parameter (lowest index) where some rank differs from rank 0, naming the ranks and
/// what each has; `None` when all agree.
pub(crate) fn first_mismatch(per_rank: &[Vec<ParamSig>]) -> Option<String> {
    let reference = &per_rank[0];
    let longest = per_rank.iter().map(Vec::len).max().unwrap_or(0);
    for i in 0..longest {
        let want = reference.get(i);
        let differing: Vec<usize> = (1..per_rank.len()).filter(|&r| per_rank[r].get(i) != want).collect();
        if differing.is_empty() {
            continue;
        }
        let show = |r: usize| match per_rank[r].get(i) {
            Some(s) => format!("rank {r} has {s}"),
            None => format!("rank {r} has no parameter #{i} (only {})", per_rank[r].len()),
        };
        let mut parts = vec![show(0)];
        parts.extend(differing.iter().map(|&r| show(r)));
        return Some(format!(
            "parameter #{i} (registration order): {}; every rank must build the same model (same names, shapes, \
             dtypes, in the same order)",
            parts.join(", ")
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(name: &str, dims: &[usize]) -> ParamSig {
        ParamSig { name: name.into(), dims: dims.to_vec(), dtype: "f32".into() }
    }

    #[test]
    fn roundtrip() {
        let s = vec![sig("fc1.weight", &[4, 3]), sig("b", &[]), ParamSig { dtype: "bf16".into(), ..sig("ü", &[1]) }];
        assert_eq!(decode(&encode(&s)).unwrap(), s);
        assert!(decode(&encode(&s)[..10]).is_none());
    }

    #[test]
    fn names_the_first_mismatch_and_the_ranks() {
        let a = vec![sig("fc1.weight", &[4, 3]), sig("fc2.weight", &[2, 4])];
        let b = vec![sig("fc1.weight", &[4, 3]), sig("fc2.weight", &[2, 5])];
        let msg = first_mismatch(&[a.clone(), a.clone(), b]).unwrap();
        assert!(msg.contains("parameter #1"), "{msg}");
        assert!(msg.contains("rank 0 has `fc2.weight` [2, 4] f32"), "{msg}");
        assert!(msg.contains("rank 2 has `fc2.weight` [2, 5] f32"), "{msg}");
        assert!(!msg.contains("rank 1"), "{msg}");
        let short = vec![sig("fc1.weight", &[4, 3])];
        let msg = first_mismatch(&[a.clone(), short]).unwrap();
        assert!(msg.contains("rank 1 has no parameter #1 (only 1)"), "{msg}");
        assert!(first_mismatch(&[a.clone(), a]).is_none());
    }
}
