//! Read and write safetensors files tensor by tensor, in the dtypes that
//! published checkpoints use (F32, F16, BF16, I64, I32, BOOL, U8), without
//! going through a tensor library (candle cannot hold BOOL tensors, which
//! EAGLE-3 checkpoints carry as `t2d`).
//!
//! Invariant: every error names the file, and the tensor when there is one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

/// One tensor's raw little-endian bytes.
#[derive(Debug, Clone)]
struct Raw {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// The tensors of one safetensors file, by name.
#[derive(Debug, Clone)]
pub struct TensorFile {
    pub path: PathBuf,
    tensors: HashMap<String, Raw>,
}

impl TensorFile {
    pub fn read(path: &Path) -> Result<Self, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::from_bytes(path, &bytes)
    }

    /// Parse safetensors bytes (`path` names them in errors).
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Self, String> {
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| format!("{}: not a safetensors file: {e}", path.display()))?;
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(name, v)| {
                (
                    name,
                    Raw {
                        dtype: v.dtype(),
                        shape: v.shape().to_vec(),
                        bytes: v.data().to_vec(),
                    },
                )
            })
            .collect();
        Ok(Self {
            path: path.to_path_buf(),
            tensors,
        })
    }

    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// An empty set of tensors (`path` names it in errors).
    pub fn empty(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            tensors: HashMap::new(),
        }
    }

    /// Add (or replace) an F32 tensor.
    pub fn insert_f32(&mut self, name: &str, shape: Vec<usize>, data: &[f32]) {
        self.tensors.insert(
            name.to_string(),
            Raw {
                dtype: Dtype::F32,
                shape,
                bytes: data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            },
        );
    }

    /// Move tensor `from` of `other` in under the name `to`.
    pub fn take_from(&mut self, other: &mut TensorFile, from: &str, to: &str) -> bool {
        match other.tensors.remove(from) {
            Some(raw) => {
                self.tensors.insert(to.to_string(), raw);
                true
            }
            None => false,
        }
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|r| r.shape.as_slice())
    }

    fn raw(&self, name: &str) -> Result<&Raw, String> {
        self.tensors
            .get(name)
            .ok_or_else(|| format!("{}: missing tensor `{name}`", self.path.display()))
    }

    fn bad_dtype(&self, name: &str, dtype: Dtype, want: &str) -> String {
        format!(
            "{}: tensor `{name}` has dtype {dtype:?}, expected {want}",
            self.path.display()
        )
    }

    /// A float tensor (F32, F16 or BF16) as f32.
    pub fn f32(&self, name: &str) -> Result<Vec<f32>, String> {
        let r = self.raw(name)?;
        let b = &r.bytes;
        Ok(match r.dtype {
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            d => return Err(self.bad_dtype(name, d, "F32, F16 or BF16")),
        })
    }

    /// An integer tensor (I64 or I32) as i64.
    pub fn i64(&self, name: &str) -> Result<Vec<i64>, String> {
        let r = self.raw(name)?;
        let b = &r.bytes;
        Ok(match r.dtype {
            Dtype::I64 => b
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect(),
            Dtype::I32 => b
                .chunks_exact(4)
                .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
            d => return Err(self.bad_dtype(name, d, "I64 or I32")),
        })
    }

    /// A BOOL (or U8) tensor.
    pub fn bool(&self, name: &str) -> Result<Vec<bool>, String> {
        let r = self.raw(name)?;
        match r.dtype {
            Dtype::BOOL | Dtype::U8 => Ok(r.bytes.iter().map(|&x| x != 0).collect()),
            d => Err(self.bad_dtype(name, d, "BOOL")),
        }
    }
}

/// Data of a tensor to write.
#[derive(Debug, Clone)]
pub enum TensorData {
    F32(Vec<f32>),
    /// Stored as F16.
    F16(Vec<f32>),
    /// Stored as BF16.
    BF16(Vec<f32>),
    I64(Vec<i64>),
    Bool(Vec<bool>),
}

impl TensorData {
    fn encode(&self) -> (Dtype, Vec<u8>) {
        match self {
            TensorData::F32(v) => (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            TensorData::F16(v) => (
                Dtype::F16,
                v.iter()
                    .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                    .collect(),
            ),
            TensorData::BF16(v) => (
                Dtype::BF16,
                v.iter()
                    .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                    .collect(),
            ),
            TensorData::I64(v) => (Dtype::I64, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            TensorData::Bool(v) => (Dtype::BOOL, v.iter().map(|&x| u8::from(x)).collect()),
        }
    }
}

/// Write `tensors` (name, shape, data) to `path` (atomically: a temporary
/// file renamed into place).
pub fn write(path: &Path, tensors: &[(String, Vec<usize>, TensorData)]) -> Result<(), String> {
    let encoded: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, d)| {
            let (dt, b) = d.encode();
            (n.clone(), dt, s.clone(), b)
        })
        .collect();
    let mut views = Vec::with_capacity(encoded.len());
    for (n, dt, s, b) in &encoded {
        let v = safetensors::tensor::TensorView::new(*dt, s.clone(), b)
            .map_err(|e| format!("{}: tensor `{n}`: {e}", path.display()))?;
        views.push((n.clone(), v));
    }
    let tmp = path.with_extension("safetensors.tmp");
    safetensors::tensor::serialize_to_file(views, None, &tmp)
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_dtype_and_names_errors() {
        let dir = std::env::temp_dir().join(format!("specd-tf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.safetensors");
        write(
            &p,
            &[
                (
                    "a".into(),
                    vec![2, 2],
                    TensorData::F32(vec![1.0, -2.0, 3.5, 0.25]),
                ),
                ("h".into(), vec![3], TensorData::F16(vec![1.0, 0.5, -4.0])),
                ("i".into(), vec![2], TensorData::I64(vec![-7, 1 << 40])),
                (
                    "b".into(),
                    vec![3],
                    TensorData::Bool(vec![true, false, true]),
                ),
            ],
        )
        .unwrap();
        let f = TensorFile::read(&p).unwrap();
        assert_eq!(f.f32("a").unwrap(), vec![1.0, -2.0, 3.5, 0.25]);
        assert_eq!(f.shape("a"), Some(&[2usize, 2][..]));
        assert_eq!(f.f32("h").unwrap(), vec![1.0, 0.5, -4.0]);
        assert_eq!(f.i64("i").unwrap(), vec![-7, 1 << 40]);
        assert_eq!(f.bool("b").unwrap(), vec![true, false, true]);
        let e = f.f32("b").unwrap_err();
        assert!(e.contains("`b`") && e.contains("BOOL"), "{e}");
        let e = f.f32("nope").unwrap_err();
        assert!(
            e.contains("missing tensor `nope`") && e.contains("t.safetensors"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
