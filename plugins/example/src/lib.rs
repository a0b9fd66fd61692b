//! An example third-party proposer: "bigram" drafting. It remembers, per
//! sequence, which token most often followed each token, and drafts by
//! chaining those most frequent successors.
//!
//! Build: `cargo build --release` in this directory gives
//! `target/release/libspecd_example_proposer.so`; point a `[[proposer]]`
//! table's `path` at it.
//!
//! Options: `max_draft` (3), `panic_on_propose` (false; for failure tests).

use std::collections::HashMap;

use specd_plugin_sdk::{Caps, Host, Options, Plugin, Proposal, SeqView};

#[derive(Default)]
struct Counts {
    /// token -> (successor -> count)
    next: HashMap<u32, HashMap<u32, u32>>,
    last: Option<u32>,
}

impl Counts {
    fn push(&mut self, t: u32) {
        if let Some(p) = self.last {
            *self.next.entry(p).or_default().entry(t).or_default() += 1;
        }
        self.last = Some(t);
    }

    fn best(&self, t: u32) -> Option<u32> {
        self.next
            .get(&t)?
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            .map(|(&tok, _)| tok)
    }
}

pub struct Bigram {
    max_draft: usize,
    panic_on_propose: bool,
    seqs: HashMap<u64, Counts>,
    host: Host,
}

impl Plugin for Bigram {
    const NAME: &'static str = "example-bigram";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn default_capabilities() -> Caps {
        Caps::one_hot(3)
    }

    fn create(o: &Options, host: Host) -> Result<Self, String> {
        o.reject_unknown(&["max_draft", "panic_on_propose"])?;
        host.log(2, "example bigram proposer created");
        Ok(Self {
            max_draft: o.get("max_draft", 3usize)?,
            panic_on_propose: o.get("panic_on_propose", false)?,
            seqs: HashMap::new(),
            host,
        })
    }

    fn capabilities(&self) -> Caps {
        Caps::one_hot(self.max_draft as u32)
    }

    fn start(&mut self, seq: u64, tokens: &[u32]) -> Result<(), String> {
        let mut c = Counts::default();
        for &t in tokens {
            c.push(t);
        }
        self.seqs.insert(seq, c);
        Ok(())
    }

    fn propose(&mut self, batch: &[SeqView<'_>]) -> Result<Vec<Proposal>, String> {
        if self.panic_on_propose {
            panic!("example plugin asked to panic in propose");
        }
        let mut out = Vec::with_capacity(batch.len());
        for s in batch {
            let c = self
                .seqs
                .get(&s.seq)
                .ok_or_else(|| format!("unknown sequence {}", s.seq))?;
            let mut draft = Vec::new();
            let mut cur = s.tokens.last().copied();
            while draft.len() < s.max_draft.min(self.max_draft) {
                match cur.and_then(|t| c.best(t)) {
                    Some(n) => {
                        draft.push(n);
                        cur = Some(n);
                    }
                    None => break,
                }
            }
            out.push(Proposal::one_hot(draft));
        }
        self.host
            .counter("example_bigram_proposals", out.len() as u64);
        Ok(out)
    }

    fn observe(&mut self, seq: u64, tokens: &[u32]) -> Result<(), String> {
        let c = self
            .seqs
            .get_mut(&seq)
            .ok_or_else(|| format!("unknown sequence {seq}"))?;
        for &t in tokens {
            c.push(t);
        }
        Ok(())
    }

    fn finish(&mut self, seq: u64) {
        self.seqs.remove(&seq);
    }
}

specd_plugin_sdk::export_proposer!(Bigram);
