//! The plugin-host protocol: how a `ProcessProposer` (the daemon's side)
//! and `specd plugin-host` (the child that loads the library) talk over a
//! Unix socket.
//!
//! A frame is a little-endian `u32` payload length and the payload. The
//! parent sends one frame per exchange: any number of queued `start`,
//! `observe` and `finish` commands, then exactly one command that wants an
//! answer (`init` or `propose`); the child runs them in order and answers
//! with one frame: `OK` and the answer's payload, or `ERR` and the first
//! failure's message (later commands of the frame still run, as they would
//! in process). Only plain data crosses: token ids, floats, strings.
//!
//! Invariants: a reader never trusts a length (every read is bounds-checked
//! and a frame over `MAX_FRAME` is refused), and a malformed frame is an
//! error for the exchange, never a panic.

use std::io::{Read, Write};
use std::sync::Arc;

use crate::sampler::Distribution;
use crate::speculative::proposer::{Capabilities, Draft, DraftQ, QKind, SiblingMode};

/// Largest frame either side accepts (hidden states of a long prefill fit).
pub const MAX_FRAME: usize = 1 << 30;

pub const CMD_INIT: u8 = 1;
pub const CMD_START: u8 = 2;
pub const CMD_OBSERVE: u8 = 3;
pub const CMD_FINISH: u8 = 4;
pub const CMD_PROPOSE: u8 = 5;

pub const REPLY_OK: u8 = 0;
pub const REPLY_ERR: u8 = 1;

const Q_ONE_HOT: u8 = 0;
const Q_SPARSE: u8 = 1;
const Q_FULL: u8 = 2;
/// A tree sibling sharing an earlier node's full q (sent once).
const Q_SAME_AS: u8 = 3;

/// Encoder into a reusable buffer.
#[derive(Debug, Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn clear(&mut self) {
        self.buf.clear();
    }
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn f32(&mut self, v: f32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.buf.extend_from_slice(s.as_bytes());
    }
    pub fn u32s(&mut self, v: &[u32]) {
        self.u32(v.len() as u32);
        self.buf.reserve(v.len() * 4);
        for x in v {
            self.buf.extend_from_slice(&x.to_le_bytes());
        }
    }
    pub fn f32s(&mut self, v: &[f32]) {
        self.u32(v.len() as u32);
        self.buf.reserve(v.len() * 4);
        for x in v {
            self.buf.extend_from_slice(&x.to_le_bytes());
        }
    }

    pub fn caps(&mut self, c: &Capabilities) {
        let hidden: Vec<u32> = c.hidden_layers.iter().map(|&l| l as u32).collect();
        self.u32s(&hidden);
        self.u8(match c.q_kind {
            QKind::OneHot => Q_ONE_HOT,
            QKind::Sparse => Q_SPARSE,
            QKind::Full => Q_FULL,
        });
        self.u32(c.max_draft as u32);
        self.u8(c.tree as u8);
        self.u32(c.max_depth as u32);
        self.u8(match c.siblings {
            SiblingMode::Iid => 0,
            SiblingMode::WithoutReplacement => 1,
        });
        self.u64(c.kv_bytes_per_token as u64);
    }

    pub fn draft(&mut self, d: &Draft) {
        self.u32s(&d.tokens);
        match &d.parents {
            Some(p) => {
                self.u8(1);
                let p: Vec<u32> = p.iter().map(|&x| x as u32).collect();
                self.u32s(&p);
            }
            None => self.u8(0),
        }
        self.u32(d.q.len() as u32);
        for (i, q) in d.q.iter().enumerate() {
            match q {
                DraftQ::OneHot => self.u8(Q_ONE_HOT),
                DraftQ::Sparse(dist) => {
                    self.u8(Q_SPARSE);
                    self.u32s(&dist.ids);
                    self.f32s(&dist.probs);
                }
                DraftQ::Full(v) => {
                    let earlier = d.q[..i]
                        .iter()
                        .position(|e| matches!(e, DraftQ::Full(w) if Arc::ptr_eq(v, w)));
                    match earlier {
                        Some(j) => {
                            self.u8(Q_SAME_AS);
                            self.u32(j as u32);
                        }
                        None => {
                            self.u8(Q_FULL);
                            self.f32s(v);
                        }
                    }
                }
            }
        }
    }
}

/// Bounds-checked decoder over one frame.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Bytes of sparse q that `Q_SAME_AS` entries have copied so far, in
    /// every draft of the frame: at most the frame's own size.
    copied: usize,
}

fn short() -> String {
    "truncated frame".to_string()
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self {
            buf,
            pos: 0,
            copied: 0,
        }
    }
    pub fn done(&self) -> bool {
        self.pos >= self.buf.len()
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).ok_or_else(short)?;
        let s = self.buf.get(self.pos..end).ok_or_else(short)?;
        self.pos = end;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    pub fn f32(&mut self) -> Result<f32, String> {
        Ok(f32::from_bits(self.u32()?))
    }
    pub fn str(&mut self) -> Result<String, String> {
        let n = self.u32()? as usize;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
    fn count(&mut self, elem: usize) -> Result<usize, String> {
        let n = self.u32()? as usize;
        if n.checked_mul(elem)
            .is_none_or(|b| b > self.buf.len() - self.pos)
        {
            return Err(short());
        }
        Ok(n)
    }
    pub fn u32s_into(&mut self, out: &mut Vec<u32>) -> Result<(), String> {
        let n = self.count(4)?;
        out.clear();
        out.extend(
            self.take(n * 4)?
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
        Ok(())
    }
    pub fn u32s(&mut self) -> Result<Vec<u32>, String> {
        let mut v = Vec::new();
        self.u32s_into(&mut v)?;
        Ok(v)
    }
    pub fn f32s_into(&mut self, out: &mut Vec<f32>) -> Result<(), String> {
        let n = self.count(4)?;
        out.clear();
        out.extend(
            self.take(n * 4)?
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
        Ok(())
    }
    pub fn f32s(&mut self) -> Result<Vec<f32>, String> {
        let mut v = Vec::new();
        self.f32s_into(&mut v)?;
        Ok(v)
    }

    pub fn caps(&mut self) -> Result<Capabilities, String> {
        let hidden_layers = self.u32s()?.into_iter().map(|l| l as usize).collect();
        let q_kind = match self.u8()? {
            Q_ONE_HOT => QKind::OneHot,
            Q_SPARSE => QKind::Sparse,
            Q_FULL => QKind::Full,
            k => return Err(format!("unknown q kind {k}")),
        };
        Ok(Capabilities {
            hidden_layers,
            q_kind,
            max_draft: self.u32()? as usize,
            tree: self.u8()? != 0,
            max_depth: self.u32()? as usize,
            siblings: if self.u8()? == 0 {
                SiblingMode::Iid
            } else {
                SiblingMode::WithoutReplacement
            },
            // The host's configuration, not the plugin's to declare.
            token_cost: None,
            kv_bytes_per_token: self.u64()? as usize,
        })
    }

    /// One draft of at most `max_tokens` tokens (what was asked for), with
    /// one q per token; what a `Q_SAME_AS` copies, in this draft and every
    /// other of the frame, counts against the frame's size, so no reply
    /// makes the reader allocate much more than the reply itself.
    pub fn draft(&mut self, max_tokens: usize) -> Result<Draft, String> {
        let tokens = self.u32s()?;
        if tokens.len() > max_tokens {
            return Err(format!(
                "{} draft tokens, at most {max_tokens} were asked for",
                tokens.len()
            ));
        }
        let parents = match self.u8()? {
            0 => None,
            _ => Some(self.u32s()?.into_iter().map(|p| p as i32).collect()),
        };
        let n = self.count(1)?;
        if n != tokens.len() {
            return Err(format!("{n} q entries for {} draft tokens", tokens.len()));
        }
        let mut q: Vec<DraftQ> = Vec::with_capacity(n);
        for _ in 0..n {
            let e = match self.u8()? {
                Q_ONE_HOT => DraftQ::OneHot,
                Q_SPARSE => DraftQ::Sparse(Distribution {
                    ids: self.u32s()?,
                    probs: self.f32s()?,
                }),
                Q_FULL => DraftQ::Full(self.f32s()?.into()),
                Q_SAME_AS => {
                    let j = self.u32()? as usize;
                    let e = q
                        .get(j)
                        .ok_or_else(|| format!("q refers to node {j}, not yet sent"))?;
                    // A full q is shared (`Arc`); a sparse one is copied.
                    if let DraftQ::Sparse(d) = e {
                        self.copied = self.copied.saturating_add(8 * d.ids.len());
                        if self.copied > self.buf.len() {
                            return Err("sparse q copies exceed the frame's size".into());
                        }
                    }
                    e.clone()
                }
                k => return Err(format!("unknown q kind {k}")),
            };
            q.push(e);
        }
        Ok(Draft {
            tokens,
            q,
            parents,
            source: None,
        })
    }
}

/// Write one frame (`payload` as is, after its length). A payload the
/// reader would refuse (over `MAX_FRAME`) is an error here, before a byte
/// is written, so the stream never carries a wrapped length.
pub fn write_frame(w: &mut impl Write, payload: &[u8]) -> std::io::Result<()> {
    if payload.len() > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "a {} byte frame, over the protocol's {MAX_FRAME}",
                payload.len()
            ),
        ));
    }
    w.write_all(&(payload.len() as u32).to_le_bytes())?;
    w.write_all(payload)?;
    w.flush()
}

/// Read one frame into `buf` (reused); `Ok(false)` at a clean end of
/// stream before a frame started.
pub fn read_frame(r: &mut impl Read, buf: &mut Vec<u8>) -> std::io::Result<bool> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..])? {
            0 if got == 0 => return Ok(false),
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => got += n,
        }
    }
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {n} bytes is over the limit"),
        ));
    }
    // Grown as bytes arrive, not sized from the header alone.
    buf.clear();
    r.take(n as u64).read_to_end(buf)?;
    if buf.len() < n {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_and_capabilities_survive_the_wire_exactly() {
        let full: Arc<[f32]> = vec![0.25f32, 0.5, 0.25].into();
        let drafts = vec![
            Draft {
                tokens: vec![5, 6, 7],
                q: vec![
                    DraftQ::Full(full.clone()),
                    DraftQ::Full(full.clone()),
                    DraftQ::Sparse(Distribution {
                        ids: vec![7, 1],
                        probs: vec![0.75, 0.25],
                    }),
                ],
                parents: Some(vec![-1, -1, 0]),
                source: None,
            },
            Draft::default(),
            Draft {
                tokens: vec![9],
                q: vec![DraftQ::OneHot],
                parents: None,
                source: None,
            },
        ];
        let caps = Capabilities {
            hidden_layers: vec![3, 30],
            q_kind: QKind::Full,
            max_draft: 16,
            tree: true,
            max_depth: 5,
            siblings: SiblingMode::Iid,
            token_cost: None,
            kv_bytes_per_token: 46_088,
        };
        let mut w = Writer::default();
        w.caps(&caps);
        for d in &drafts {
            w.draft(d);
        }
        let mut r = Reader::new(&w.buf);
        assert_eq!(r.caps().unwrap(), caps);
        let back: Vec<Draft> = (0..3).map(|_| r.draft(8).unwrap()).collect();
        assert_eq!(back, drafts);
        assert!(r.done());
        // Siblings still share one q after the trip.
        match (&back[0].q[0], &back[0].q[1]) {
            (DraftQ::Full(a), DraftQ::Full(b)) => assert!(Arc::ptr_eq(a, b)),
            _ => unreachable!(),
        }
        // Every truncation is an error, never a panic.
        for cut in 0..w.buf.len() {
            let mut r = Reader::new(&w.buf[..cut]);
            let ok = r.caps().is_ok() && (0..3).all(|_| r.draft(8).is_ok());
            assert!(!ok, "a frame cut at {cut} bytes decoded");
        }
        // More tokens than were asked for is an error, not an allocation.
        let mut r = Reader::new(&w.buf);
        r.caps().unwrap();
        let e = r.draft(2).unwrap_err();
        assert!(e.contains("3 draft tokens, at most 2"), "{e}");
    }

    #[test]
    fn a_small_reply_cannot_make_the_reader_allocate_without_bound() {
        // One sparse q of 4096 entries, then 4096 nodes that each copy it:
        // 48 KB on the wire, 16M entries (200 MB) if copies were free.
        let k = 4096u32;
        let mut w = Writer::default();
        w.u32s(&vec![1; k as usize]);
        w.u8(0);
        w.u32(k);
        w.u8(Q_SPARSE);
        w.u32s(&(0..k).collect::<Vec<_>>());
        w.f32s(&vec![1.0 / k as f32; k as usize]);
        for _ in 1..k {
            w.u8(Q_SAME_AS);
            w.u32(0);
        }
        let e = Reader::new(&w.buf).draft(k as usize).unwrap_err();
        assert!(e.contains("exceed the frame"), "{e}");
        // Nor can many drafts in one frame, each within the frame's size
        // alone: 64 drafts of a 512-entry q and 7 copies of it (28 KB of
        // copies each against 4 KB on the wire) add up to 7x the 268 KB
        // frame.
        let mut w = Writer::default();
        for _ in 0..64 {
            w.u32s(&[1; 8]);
            w.u8(0);
            w.u32(8);
            w.u8(Q_SPARSE);
            w.u32s(&(0..512).collect::<Vec<_>>());
            w.f32s(&[1.0 / 512.0; 512]);
            for _ in 1..8 {
                w.u8(Q_SAME_AS);
                w.u32(0);
            }
        }
        let mut r = Reader::new(&w.buf);
        let e = (0..64)
            .map(|_| r.draft(8).map(|_| ()))
            .find_map(Result::err)
            .expect("the frame's copies were all allowed");
        assert!(e.contains("exceed the frame"), "{e}");
        // A q count that is not the token count is refused before any q.
        let mut w = Writer::default();
        w.u32s(&[1, 2]);
        w.u8(0);
        w.u32(3);
        for _ in 0..3 {
            w.u8(Q_ONE_HOT);
        }
        let e = Reader::new(&w.buf).draft(8).unwrap_err();
        assert!(e.contains("3 q entries for 2 draft tokens"), "{e}");
    }

    #[test]
    fn frames_round_trip_and_lengths_are_not_trusted() {
        let mut out = Vec::new();
        write_frame(&mut out, b"hello").unwrap();
        write_frame(&mut out, b"").unwrap();
        let mut r = std::io::Cursor::new(out);
        let mut buf = Vec::new();
        assert!(read_frame(&mut r, &mut buf).unwrap());
        assert_eq!(buf, b"hello");
        assert!(read_frame(&mut r, &mut buf).unwrap());
        assert!(buf.is_empty());
        assert!(!read_frame(&mut r, &mut buf).unwrap());
        let mut huge = std::io::Cursor::new(u32::MAX.to_le_bytes().to_vec());
        assert!(read_frame(&mut huge, &mut buf).is_err());
        let mut r = Reader::new(&[255, 255, 255, 255]);
        assert!(r.u32s().is_err());
    }
}
