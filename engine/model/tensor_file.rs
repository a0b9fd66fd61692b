//! Read and write safetensors files tensor by tensor, in the dtypes that
//! published checkpoints use (F32, F16, BF16, I64, I32, BOOL, U8), without
//! going through a tensor library (candle cannot hold BOOL tensors, which
//! EAGLE-3 checkpoints carry as `t2d`).
//!
//! Invariant: every error names the file, and the tensor when there is one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorInfo;
pub use safetensors::Dtype;
use safetensors::SafeTensors;

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
        let mut v = vec![0f32; r.bytes.len() / dtype_size(r.dtype).unwrap_or(1)];
        floats_into(r.dtype, &r.bytes, &mut v)
            .map_err(|d| self.bad_dtype(name, d, "F32, F16 or BF16"))?;
        Ok(v)
    }

    /// An integer tensor (I64 or I32) as i64.
    pub fn i64(&self, name: &str) -> Result<Vec<i64>, String> {
        let r = self.raw(name)?;
        ints(r.dtype, &r.bytes).map_err(|d| self.bad_dtype(name, d, "I64 or I32"))
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

/// Little-endian F32, F16 or BF16 `bytes` decoded into `dst` (Err: the
/// dtype, when it is none of those).
fn floats_into(dtype: Dtype, bytes: &[u8], dst: &mut [f32]) -> Result<(), Dtype> {
    match dtype {
        Dtype::F32 => {
            for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Dtype::F16 => {
            for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        Dtype::BF16 => {
            for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                *d = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        d => return Err(d),
    }
    Ok(())
}

/// Little-endian I64 or I32 `bytes` as i64 (Err: the dtype, when it is
/// neither).
fn ints(dtype: Dtype, bytes: &[u8]) -> Result<Vec<i64>, Dtype> {
    Ok(match dtype {
        Dtype::I64 => bytes
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect(),
        Dtype::I32 => bytes
            .chunks_exact(4)
            .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
        d => return Err(d),
    })
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

/// Where one tensor of a [`RowFile`] lies.
#[derive(Debug, Clone)]
struct RowInfo {
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte offset of the tensor's first element.
    start: u64,
    /// Bytes of one row (the product of every dimension but the first).
    row_bytes: usize,
}

/// Bytes per element (`None` for dtypes narrower than a byte).
fn dtype_size(d: Dtype) -> Option<usize> {
    let bits = d.bitsize();
    bits.is_multiple_of(8).then_some(bits / 8)
}

/// A safetensors file read and written a range of rows at a time, for
/// tensors larger than memory (a trainer's recorded target states: one row
/// per token of a corpus). The file is a plain safetensors file; nothing
/// of it is held in memory but its header.
///
/// Invariants: a file being written lives under a `.tmp` name until
/// [`RowFile::finish`] renames it into place, so a crash never leaves a
/// complete-looking file with unwritten rows; every read and write is
/// bounds-checked against the header, and every error names the file and
/// the tensor.
#[derive(Debug)]
pub struct RowFile {
    path: PathBuf,
    file: std::fs::File,
    tensors: HashMap<String, RowInfo>,
    writing: Option<PathBuf>,
}

impl RowFile {
    /// Start writing `path`: every tensor (name, dtype, shape) laid out in
    /// this order, their bytes zero until written.
    pub fn create(path: &Path, tensors: &[(&str, Dtype, Vec<usize>)]) -> Result<Self, String> {
        let mut header = serde_json::Map::new();
        let mut infos = HashMap::new();
        let mut off = 0usize;
        let mut layout = Vec::new();
        for (name, dtype, shape) in tensors {
            if header.contains_key(*name) {
                return Err(format!("{}: tensor `{name}` named twice", path.display()));
            }
            let size = dtype_size(*dtype).ok_or_else(|| {
                format!(
                    "{}: tensor `{name}`: dtype {dtype:?} is not supported",
                    path.display()
                )
            })?;
            let row = shape.iter().skip(1).product::<usize>() * size;
            let bytes = shape.iter().product::<usize>() * size;
            let info = TensorInfo {
                dtype: *dtype,
                shape: shape.clone(),
                data_offsets: (off, off + bytes),
            };
            header.insert(
                (*name).to_string(),
                serde_json::to_value(info).map_err(|e| format!("{}: {e}", path.display()))?,
            );
            layout.push((name.to_string(), *dtype, shape.clone(), off, row));
            off += bytes;
        }
        let mut json = serde_json::Value::Object(header).to_string().into_bytes();
        // The data starts 8-byte aligned, as safetensors writers pad it.
        while !(8 + json.len()).is_multiple_of(8) {
            json.push(b' ');
        }
        let base = (8 + json.len()) as u64;
        for (name, dtype, shape, o, row_bytes) in layout {
            infos.insert(
                name,
                RowInfo {
                    dtype,
                    shape,
                    start: base + o as u64,
                    row_bytes,
                },
            );
        }
        let tmp = path.with_extension("safetensors.tmp");
        let io = |e: std::io::Error| format!("{}: {e}", tmp.display());
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(io)?;
        use std::os::unix::fs::FileExt;
        file.write_all_at(&(json.len() as u64).to_le_bytes(), 0)
            .map_err(io)?;
        file.write_all_at(&json, 8).map_err(io)?;
        file.set_len(base + off as u64).map_err(io)?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            tensors: infos,
            writing: Some(tmp),
        })
    }

    /// Open a complete file for reading (its header checked against its
    /// length).
    pub fn open(path: &Path) -> Result<Self, String> {
        use std::os::unix::fs::FileExt;
        let io = |e: std::io::Error| format!("{}: {e}", path.display());
        let bad = |what: &str| format!("{}: not a safetensors file: {what}", path.display());
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0).map_err(io)?;
        let n = u64::from_le_bytes(n);
        if n > 100 << 20 || 8 + n > len {
            return Err(bad("header length past the end"));
        }
        let mut json = vec![0u8; n as usize];
        file.read_exact_at(&mut json, 8).map_err(io)?;
        let header: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&json).map_err(|e| bad(&e.to_string()))?;
        let base = 8 + n;
        let mut tensors = HashMap::new();
        for (name, v) in header {
            if name == "__metadata__" {
                continue;
            }
            let TensorInfo {
                dtype,
                shape,
                data_offsets: (a, b),
            } = serde_json::from_value(v).map_err(|e| bad(&format!("tensor `{name}`: {e}")))?;
            let (a, b) = (a as u64, b as u64);
            let size = dtype_size(dtype).ok_or_else(|| {
                bad(&format!(
                    "tensor `{name}`: dtype {dtype:?} is narrower than a byte"
                ))
            })?;
            let bytes = shape
                .iter()
                .try_fold(size as u64, |a, &d| a.checked_mul(d as u64));
            let fits = bytes.is_some_and(|bytes| {
                b.checked_sub(a) == Some(bytes) && base.checked_add(b).is_some_and(|e| e <= len)
            });
            if !fits {
                return Err(bad(&format!(
                    "tensor `{name}`: data offsets do not match its shape and the file"
                )));
            }
            tensors.insert(
                name,
                RowInfo {
                    dtype,
                    row_bytes: shape.iter().skip(1).product::<usize>() * size,
                    shape,
                    start: base + a,
                },
            );
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            tensors,
            writing: None,
        })
    }

    /// Rename a file being written into place; it reads on as before.
    pub fn finish(mut self) -> Result<Self, String> {
        if let Some(tmp) = self.writing.take() {
            self.file
                .sync_data()
                .map_err(|e| format!("{}: {e}", tmp.display()))?;
            std::fs::rename(&tmp, &self.path)
                .map_err(|e| format!("{}: {e}", self.path.display()))?;
        }
        Ok(self)
    }

    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|r| r.shape.as_slice())
    }

    fn shown(&self) -> String {
        self.writing
            .as_deref()
            .unwrap_or(&self.path)
            .display()
            .to_string()
    }

    /// The byte range of rows `r0..r0 + n` of `name`, checked.
    fn span(&self, name: &str, r0: usize, n: usize) -> Result<(&RowInfo, u64, usize), String> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| format!("{}: missing tensor `{name}`", self.shown()))?;
        let rows = info.shape.first().copied().unwrap_or(1);
        if r0 + n > rows {
            return Err(format!(
                "{}: tensor `{name}`: rows {r0}..{} past its {rows}",
                self.shown(),
                r0 + n
            ));
        }
        Ok((
            info,
            info.start + (r0 * info.row_bytes) as u64,
            n * info.row_bytes,
        ))
    }

    /// Write rows `r0..` of an F16 tensor from f32 values (a whole number
    /// of rows).
    pub fn write_f16_rows(&self, name: &str, r0: usize, data: &[f32]) -> Result<(), String> {
        use std::os::unix::fs::FileExt;
        let row = self
            .tensors
            .get(name)
            .map_or(1, |i| (i.row_bytes / 2).max(1));
        let (info, at, len) = self.span(name, r0, data.len() / row)?;
        if info.dtype != Dtype::F16 || len != data.len() * 2 {
            return Err(format!(
                "{}: tensor `{name}`: {} values are not whole F16 rows of it",
                self.shown(),
                data.len()
            ));
        }
        let bytes: Vec<u8> = data
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect();
        self.file
            .write_all_at(&bytes, at)
            .map_err(|e| format!("{}: tensor `{name}`: {e}", self.shown()))
    }

    /// Write a whole I64 tensor.
    pub fn write_i64(&self, name: &str, data: &[i64]) -> Result<(), String> {
        use std::os::unix::fs::FileExt;
        let (info, at, len) = self.span(
            name,
            0,
            self.tensors
                .get(name)
                .map_or(0, |i| i.shape.first().copied().unwrap_or(1)),
        )?;
        if info.dtype != Dtype::I64 || len != data.len() * 8 {
            return Err(format!(
                "{}: tensor `{name}`: not an I64 tensor of {} values",
                self.shown(),
                data.len()
            ));
        }
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.file
            .write_all_at(&bytes, at)
            .map_err(|e| format!("{}: tensor `{name}`: {e}", self.shown()))
    }

    /// Read rows `r0..` of a float tensor (F32, F16 or BF16) into `dst`
    /// (a whole number of rows) as f32.
    pub fn read_rows(&self, name: &str, r0: usize, dst: &mut [f32]) -> Result<(), String> {
        use std::os::unix::fs::FileExt;
        let size = self
            .tensors
            .get(name)
            .and_then(|i| dtype_size(i.dtype))
            .unwrap_or(4);
        let per_row = self
            .tensors
            .get(name)
            .map_or(1, |i| (i.row_bytes / size).max(1));
        let (info, at, len) = self.span(name, r0, dst.len() / per_row)?;
        if len != dst.len() * size {
            return Err(format!(
                "{}: tensor `{name}`: {} values are not whole rows of it",
                self.shown(),
                dst.len()
            ));
        }
        let mut bytes = vec![0u8; len];
        self.file
            .read_exact_at(&mut bytes, at)
            .map_err(|e| format!("{}: tensor `{name}`: {e}", self.shown()))?;
        floats_into(info.dtype, &bytes, dst).map_err(|d| {
            format!(
                "{}: tensor `{name}` has dtype {d:?}, expected F32, F16 or BF16",
                self.shown()
            )
        })?;
        Ok(())
    }

    /// A whole I64 or I32 tensor.
    pub fn read_i64(&self, name: &str) -> Result<Vec<i64>, String> {
        use std::os::unix::fs::FileExt;
        let rows = self
            .tensors
            .get(name)
            .map_or(0, |i| i.shape.first().copied().unwrap_or(1));
        let (info, at, len) = self.span(name, 0, rows)?;
        let mut bytes = vec![0u8; len];
        self.file
            .read_exact_at(&mut bytes, at)
            .map_err(|e| format!("{}: tensor `{name}`: {e}", self.shown()))?;
        ints(info.dtype, &bytes).map_err(|d| {
            format!(
                "{}: tensor `{name}` has dtype {d:?}, expected I64 or I32",
                self.shown()
            )
        })
    }
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

    #[test]
    fn row_files_write_and_read_row_ranges_as_safetensors() {
        let dir = std::env::temp_dir().join(format!("specd-rf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("rows.safetensors");
        let w = RowFile::create(
            &p,
            &[
                ("ids", Dtype::I64, vec![3]),
                ("x", Dtype::F16, vec![3, 2]),
                ("y", Dtype::F16, vec![3, 1]),
            ],
        )
        .unwrap();
        assert!(
            !p.exists(),
            "the file is not in place before it is finished"
        );
        w.write_f16_rows("x", 1, &[1.5, -2.0, 0.25, 8.0]).unwrap();
        w.write_f16_rows("x", 0, &[3.0, 4.0]).unwrap();
        w.write_f16_rows("y", 0, &[1.0, 2.0, 3.0]).unwrap();
        w.write_i64("ids", &[7, -1, 1 << 40]).unwrap();
        let e = w.write_f16_rows("x", 2, &[1.0, 2.0, 3.0, 4.0]).unwrap_err();
        assert!(e.contains("`x`") && e.contains("past"), "{e}");
        let e = w.write_f16_rows("x", 0, &[1.0]).unwrap_err();
        assert!(e.contains("whole F16 rows"), "{e}");
        w.finish().unwrap();
        // A standard safetensors reader sees the same tensors.
        let f = TensorFile::read(&p).unwrap();
        assert_eq!(f.f32("x").unwrap(), vec![3.0, 4.0, 1.5, -2.0, 0.25, 8.0]);
        assert_eq!(f.i64("ids").unwrap(), vec![7, -1, 1 << 40]);
        let r = RowFile::open(&p).unwrap();
        assert_eq!(r.shape("x"), Some(&[3usize, 2][..]));
        let mut two = [0f32; 4];
        r.read_rows("x", 1, &mut two).unwrap();
        assert_eq!(two, [1.5, -2.0, 0.25, 8.0]);
        let mut one = [0f32; 1];
        r.read_rows("y", 2, &mut one).unwrap();
        assert_eq!(one, [3.0]);
        assert_eq!(r.read_i64("ids").unwrap(), vec![7, -1, 1 << 40]);
        let e = r.read_rows("x", 3, &mut [0f32; 2]).unwrap_err();
        assert!(e.contains("rows.safetensors") && e.contains("past"), "{e}");
        let e = r.read_rows("nope", 0, &mut [0f32; 2]).unwrap_err();
        assert!(e.contains("missing tensor `nope`"), "{e}");
        // A file written by the standard writer opens too; a truncated one
        // is refused by name.
        write(
            &p,
            &[(
                "z".into(),
                vec![2, 2],
                TensorData::F32(vec![1.0, 2.0, 3.0, 4.0]),
            )],
        )
        .unwrap();
        let mut z = [0f32; 2];
        RowFile::open(&p)
            .unwrap()
            .read_rows("z", 1, &mut z)
            .unwrap();
        assert_eq!(z, [3.0, 4.0]);
        let bytes = std::fs::read(&p).unwrap();
        let e = RowFile::create(
            &dir.join("twice.safetensors"),
            &[("a", Dtype::F16, vec![1, 1]), ("a", Dtype::F16, vec![1, 1])],
        )
        .unwrap_err();
        assert!(e.contains("`a` named twice"), "{e}");
        std::fs::write(&p, &bytes[..bytes.len() - 4]).unwrap();
        let e = RowFile::open(&p).unwrap_err();
        assert!(e.contains("`z`") && e.contains("rows.safetensors"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
