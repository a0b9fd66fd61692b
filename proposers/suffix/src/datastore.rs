//! A static datastore of the target's own earlier outputs (a specd corpus,
//! `specd distill corpus`): the responses in one token array, a suffix
//! array over it sorted by the first `depth` tokens of each suffix, and
//! the same trie walk the suffix trees give (the suffixes starting with a
//! path form one contiguous range, its children contiguous sub-ranges, a
//! node's count the range's length). SuffixDecoding's global tree seeded
//! with earlier outputs, at 8 bytes a token instead of a trie node per
//! suffix window.

use std::io::Read;

/// Ends every response: matches no token, so no path crosses it.
const SEP: u32 = u32::MAX;

/// The corpus shard format `specd distill corpus` writes
/// (engine/distill/corpus.rs): the magic, then per sample a source byte,
/// temperature (f32), seed (u64), prompt index, prompt length and total
/// length (u32 each), then the token ids (u32 each), little-endian, all
/// gzip-compressed.
const MAGIC: &[u8] = b"SPECDCORPUS1";

/// A node: the suffix-array range `lo..hi` of the suffixes starting with a
/// path of `depth` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub lo: u32,
    pub hi: u32,
    pub depth: u16,
}

#[derive(Debug, Clone)]
pub struct Datastore {
    text: Vec<u32>,
    sa: Vec<u32>,
    depth: usize,
}

impl Datastore {
    /// Index `docs`, each a response; paths are at most `depth` tokens.
    pub fn new(docs: &[Vec<u32>], depth: usize) -> Self {
        let depth = depth.clamp(1, u16::MAX as usize);
        let mut text = Vec::with_capacity(docs.iter().map(|d| d.len() + 1).sum());
        for d in docs {
            text.extend(d.iter().map(|&t| t.min(SEP - 1)));
            text.push(SEP);
        }
        // Suffixes starting at a separator are never walked.
        let mut sa: Vec<u32> = (0..text.len() as u32)
            .filter(|&i| text[i as usize] != SEP)
            .collect();
        let key = |i: u32| {
            let i = i as usize;
            &text[i..(i + depth).min(text.len())]
        };
        sa.sort_unstable_by(|&a, &b| key(a).cmp(key(b)).then(a.cmp(&b)));
        Self { text, sa, depth }
    }

    /// Tokens indexed (separators excluded).
    pub fn tokens(&self) -> usize {
        self.sa.len()
    }

    /// The child of `s` by token `t`, if any suffix continues so.
    fn child(&self, s: Span, t: u32) -> Option<Span> {
        let d = s.depth as usize;
        if d >= self.depth {
            return None;
        }
        let (lo, hi) = (s.lo as usize, s.hi as usize);
        let a = lo + self.sa[lo..hi].partition_point(|&i| self.tok(i, d) < t);
        let b = a + self.sa[a..hi].partition_point(|&i| self.tok(i, d) <= t);
        (b > a).then_some(Span {
            lo: a as u32,
            hi: b as u32,
            depth: s.depth + 1,
        })
    }

    /// The token `d` places into the suffix starting at `i` (`SEP` past a
    /// response).
    #[inline]
    fn tok(&self, i: u32, d: usize) -> u32 {
        self.text.get(i as usize + d).copied().unwrap_or(SEP)
    }

    /// Suffixes of `s` that continue (do not end at a separator): the sum
    /// of its children's counts.
    fn continuing(&self, s: Span) -> u32 {
        let d = s.depth as usize;
        if d >= self.depth {
            return 0;
        }
        let (lo, hi) = (s.lo as usize, s.hi as usize);
        self.sa[lo..hi].partition_point(|&i| self.tok(i, d) < SEP) as u32
    }

    /// Longest suffix of `context` (at most the index depth) present with
    /// at least one continuation: `(node, match length)`.
    pub fn longest_match(&self, context: &[u32]) -> Option<(Span, usize)> {
        // A path occurs only if every suffix of it does: grow the match
        // from the last token until it no longer occurs, each length one
        // range search over whole slices (two binary searches).
        let n = context.len();
        let mut best = None;
        for len in 1..=self.depth.min(n) {
            let Some(s) = self.find(&context[n - len..]) else {
                break;
            };
            if self.continuing(s) > 0 {
                best = Some((s, len));
            }
        }
        best
    }

    /// The node of path `p` (`p.len() <= depth`), if it occurs.
    fn find(&self, p: &[u32]) -> Option<Span> {
        let head = |i: u32| {
            let i = i as usize;
            &self.text[i..(i + p.len()).min(self.text.len())]
        };
        let a = self.sa.partition_point(|&i| head(i) < p);
        let b = a + self.sa[a..].partition_point(|&i| head(i) == p);
        (b > a).then_some(Span {
            lo: a as u32,
            hi: b as u32,
            depth: p.len() as u16,
        })
    }

    /// The children of `s` whose count is at least `min_prob` of the
    /// continuing suffixes, as `(token, count, node)` in token order, and
    /// that total. A child that large spans one of the probe points every
    /// `min_prob * total` suffixes, so only those are looked up.
    pub fn children(&self, s: Span, min_prob: f64) -> (Vec<(u32, u32, Span)>, u32) {
        let total = self.continuing(s);
        let mut out = Vec::new();
        if total == 0 {
            return (out, 0);
        }
        // One below the floor, so rounding never skips a child at the bound.
        let step = ((min_prob * f64::from(total)).floor() as usize)
            .saturating_sub(1)
            .max(1);
        let d = s.depth as usize;
        let lo = s.lo as usize;
        let end = lo + total as usize;
        let mut k = lo;
        while k < end {
            let t = self.tok(self.sa[k], d);
            let c = self.child(s, t).expect("a probed token has a child");
            let count = c.hi - c.lo;
            if f64::from(count) / f64::from(total) >= min_prob {
                out.push((t, count, c));
            }
            // The next probe point past this child's range.
            let next = c.hi as usize;
            k = if step == 1 {
                next
            } else {
                let j = (k - lo) / step + 1;
                (lo + j * step).max(next)
            };
        }
        (out, total)
    }
}

/// The responses of every `shard-*.bin.gz` in `dir` (a specd corpus), in
/// file-name order; prompts are left out (the datastore drafts what the
/// target says, not what users ask).
pub fn read_corpus_dir(dir: &std::path::Path) -> Result<Vec<Vec<u32>>, String> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| format!("corpus `{}`: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("shard-") && n.ends_with(".bin.gz"))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!(
            "corpus `{}`: no shard-*.bin.gz files (a directory `specd distill corpus` wrote)",
            dir.display()
        ));
    }
    let mut docs = Vec::new();
    for f in files {
        let gz = std::fs::read(&f).map_err(|e| format!("corpus `{}`: {e}", f.display()))?;
        read_shard(&gz, &mut docs).map_err(|e| format!("corpus `{}`: {e}", f.display()))?;
    }
    Ok(docs)
}

/// Append the responses of one gzip-compressed shard to `docs`.
pub fn read_shard(gz: &[u8], docs: &mut Vec<Vec<u32>>) -> Result<(), String> {
    let mut b = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut b)
        .map_err(|e| format!("not a gzip stream: {e}"))?;
    let mut r = b
        .strip_prefix(MAGIC)
        .ok_or("not a specd corpus shard (magic)")?;
    let u32_at = |b: &[u8], o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    // Header: source 1, temperature 4, seed 8, index 4, prompt 4, total 4.
    const HEAD: usize = 25;
    while !r.is_empty() {
        if r.len() < HEAD {
            return Err("ends inside a sample header".into());
        }
        let prompt = u32_at(r, 17) as usize;
        let len = u32_at(r, 21) as usize;
        if prompt > len || r.len() < HEAD + 4 * len {
            return Err("a sample's header is corrupt or the shard is truncated".into());
        }
        let toks = &r[HEAD..HEAD + 4 * len];
        docs.push((prompt..len).map(|j| u32_at(toks, 4 * j)).collect());
        r = &r[HEAD + 4 * len..];
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SuffixTree;

    fn lcg(s: &mut u64) -> u32 {
        *s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*s >> 33) as u32
    }

    #[test]
    fn counts_and_matches_equal_a_suffix_tree_of_the_same_documents() {
        let mut seed = 3u64;
        // Small alphabets: many repeats, deep shared paths.
        let docs: Vec<Vec<u32>> = (0..40)
            .map(|_| {
                let n = 5 + lcg(&mut seed) as usize % 40;
                (0..n).map(|_| lcg(&mut seed) % 5).collect()
            })
            .collect();
        let depth = 6;
        let ds = Datastore::new(&docs, depth);
        let mut tree = SuffixTree::new(depth);
        for d in &docs {
            tree.insert(d);
        }
        assert_eq!(ds.tokens(), docs.iter().map(Vec::len).sum::<usize>());
        for _ in 0..300 {
            let n = 1 + lcg(&mut seed) as usize % 9;
            let ctx: Vec<u32> = (0..n).map(|_| lcg(&mut seed) % 6).collect();
            let (a, b) = (ds.longest_match(&ctx), tree.longest_match(&ctx));
            assert_eq!(a.map(|m| m.1), b.map(|m| m.1), "{ctx:?}");
            let (Some((s, _)), Some((node, _))) = (a, b) else {
                continue;
            };
            // Every child with its count, as the trie holds them.
            let (kids, total) = ds.children(s, 0.0);
            let want: Vec<(u32, u32)> = crate::Walk::kids(&tree, node, 0.0)
                .0
                .iter()
                .map(|k| (k.0, k.1))
                .collect();
            let got: Vec<(u32, u32)> = kids.iter().map(|k| (k.0, k.1)).collect();
            assert_eq!(got, want, "{ctx:?}");
            assert_eq!(total, want.iter().map(|k| k.1).sum::<u32>());
            // With a floor, exactly the children that reach it.
            for p in [0.2, 0.34, 0.5, 0.9] {
                let (kids, _) = ds.children(s, p);
                let got: Vec<(u32, u32)> = kids.iter().map(|k| (k.0, k.1)).collect();
                let want: Vec<(u32, u32)> = want
                    .iter()
                    .copied()
                    .filter(|k| f64::from(k.1) / f64::from(total) >= p)
                    .collect();
                assert_eq!(got, want, "{ctx:?} min_prob {p}");
            }
        }
    }

    #[test]
    fn shards_read_back_responses_and_reject_corruption() {
        use std::io::Write;
        let mut raw = MAGIC.to_vec();
        for (prompt, toks) in [(2u32, vec![7u32, 8, 9, 10]), (0, vec![1, 2])] {
            raw.push(0);
            raw.extend_from_slice(&0.7f32.to_le_bytes());
            raw.extend_from_slice(&5u64.to_le_bytes());
            raw.extend_from_slice(&3u32.to_le_bytes());
            raw.extend_from_slice(&prompt.to_le_bytes());
            raw.extend_from_slice(&(toks.len() as u32).to_le_bytes());
            for t in toks {
                raw.extend_from_slice(&t.to_le_bytes());
            }
        }
        let gz = |b: &[u8]| {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(b).unwrap();
            e.finish().unwrap()
        };
        let mut docs = Vec::new();
        read_shard(&gz(&raw), &mut docs).unwrap();
        assert_eq!(docs, vec![vec![9, 10], vec![1, 2]]);
        let e = read_shard(&gz(&raw[..raw.len() - 3]), &mut Vec::new()).unwrap_err();
        assert!(e.contains("truncated"), "{e}");
        let e = read_shard(&gz(b"SPECDCORPUS0"), &mut Vec::new()).unwrap_err();
        assert!(e.contains("magic"), "{e}");
        let e = read_shard(b"plain bytes", &mut Vec::new()).unwrap_err();
        assert!(e.contains("gzip"), "{e}");
    }
}
