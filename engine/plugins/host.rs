//! `specd plugin-host`: the child side of process isolation. It connects to
//! the daemon's socket, loads one plugin library, creates one instance and
//! answers the daemon's frames (see `wire`) until the socket closes.
//!
//! Invariant: the child holds no state the daemon cannot rebuild: when it
//! dies, the daemon starts a new one and replays each live sequence's
//! tokens (`ProcessProposer`).

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use super::instance::{PluginProposer, TargetDims};
use super::wire::{self, Reader, Writer};
use crate::error::{Result, SpecdError};
use crate::sampler::SamplingParams;
use crate::speculative::proposer::{ProposeInput, Proposer};

/// One decoded sequence of a propose command (buffers reused across calls).
#[derive(Default)]
struct SeqBuf {
    seq: u64,
    max_draft: usize,
    params: SamplingParams,
    hidden_start: usize,
    tokens: Vec<u32>,
    hidden: Vec<(usize, Vec<f32>)>,
}

struct Host {
    proposer: Option<PluginProposer>,
    seqs: Vec<SeqBuf>,
    scratch: Vec<u32>,
    path: Vec<u32>,
}

/// Serve the daemon at `socket` until it hangs up.
pub fn serve(socket: &Path) -> Result<()> {
    prefer_as_oom_victim();
    let mut stream = UnixStream::connect(socket).map_err(|e| {
        SpecdError::Plugin(format!(
            "plugin host: connecting to {}: {e}",
            socket.display()
        ))
    })?;
    let mut host = Host {
        proposer: None,
        seqs: Vec::new(),
        scratch: Vec::new(),
        path: Vec::new(),
    };
    let (mut frame, mut out) = (Vec::new(), Writer::default());
    loop {
        match wire::read_frame(&mut stream, &mut frame) {
            Ok(true) => {}
            // The daemon hung up (or went away): nothing left to serve.
            Ok(false) | Err(_) => return Ok(()),
        }
        out.clear();
        out.u8(wire::REPLY_OK);
        if let Err(e) = host.run(&frame, &mut out) {
            out.clear();
            out.u8(wire::REPLY_ERR);
            out.str(&e);
        }
        cap_reply(&mut out, wire::MAX_FRAME);
        if wire::write_frame(&mut stream, &out.buf).is_err() {
            return Ok(());
        }
    }
}

/// A reply over `max` bytes, which the protocol cannot carry (full-q
/// drafts of a large batch), becomes an error the daemon reads, naming
/// its size, not a silent exit the daemon would restart into the same
/// reply.
fn cap_reply(out: &mut Writer, max: usize) {
    if out.buf.len() > max {
        let n = out.buf.len();
        out.clear();
        out.u8(wire::REPLY_ERR);
        out.str(&format!(
            "plugin host: a {n} byte reply, over the protocol's {max} (fewer sequences \
             or a smaller max_draft per call)"
        ));
    }
}

fn no_instance() -> String {
    "plugin host: no instance yet (init first)".to_string()
}

impl Host {
    /// Run every command of a frame; the first failure is the answer (later
    /// commands still run, as they would in process).
    fn run(&mut self, frame: &[u8], out: &mut Writer) -> std::result::Result<(), String> {
        let mut r = Reader::new(frame);
        let mut first_err = None;
        while !r.done() {
            let cmd = r.u8()?;
            let res = match cmd {
                wire::CMD_INIT => self.init(&mut r, out),
                wire::CMD_PROPOSE => self.propose(&mut r, out),
                wire::CMD_START | wire::CMD_OBSERVE | wire::CMD_FINISH => {
                    self.lifecycle(cmd, &mut r)
                }
                c => return Err(format!("plugin host: unknown command {c}")),
            };
            if let Err(e) = res {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    fn init(&mut self, r: &mut Reader<'_>, out: &mut Writer) -> std::result::Result<(), String> {
        let name = r.str()?;
        let lib_path = PathBuf::from(r.str()?);
        let options = r.str()?;
        let dims = TargetDims {
            vocab: r.u32()? as usize,
            hidden: r.u32()? as usize,
            layers: r.u32()? as usize,
        };
        let model = Some(PathBuf::from(r.str()?)).filter(|p| !p.as_os_str().is_empty());
        let options: toml::Table = options
            .parse()
            .map_err(|e| format!("proposer `{name}`: options: {e}"))?;
        let lib = super::load_library(&lib_path).map_err(|e| e.to_string())?;
        let p = PluginProposer::create_lazy(&name, lib.clone(), &options, dims, model)
            .map_err(|e| e.to_string())?;
        out.caps(&p.capabilities());
        out.str(&lib.name);
        out.str(&lib.version);
        out.str(&lib.build_id);
        out.u32(std::process::id());
        self.proposer = Some(p);
        Ok(())
    }

    fn proposer(&mut self) -> std::result::Result<&mut PluginProposer, String> {
        self.proposer.as_mut().ok_or_else(no_instance)
    }

    fn lifecycle(&mut self, cmd: u8, r: &mut Reader<'_>) -> std::result::Result<(), String> {
        let seq = r.u64()?;
        match cmd {
            wire::CMD_START => {
                r.u32s_into(&mut self.scratch)?;
                let toks = std::mem::take(&mut self.scratch);
                let res = self.proposer()?.start(seq, &toks);
                self.scratch = toks;
                res
            }
            wire::CMD_OBSERVE => {
                r.u32s_into(&mut self.scratch)?;
                r.u32s_into(&mut self.path)?;
                let (toks, path) = (
                    std::mem::take(&mut self.scratch),
                    std::mem::take(&mut self.path),
                );
                let p: Vec<usize> = path.iter().map(|&x| x as usize).collect();
                let res = self.proposer()?.observe(seq, &toks, &p);
                (self.scratch, self.path) = (toks, path);
                res
            }
            _ => {
                self.proposer()?.finish(seq);
                Ok(())
            }
        }
    }

    fn propose(&mut self, r: &mut Reader<'_>, out: &mut Writer) -> std::result::Result<(), String> {
        let n = r.u32()? as usize;
        if n > 1 << 16 {
            return Err(format!("plugin host: {n} sequences in one call"));
        }
        if self.seqs.len() < n {
            self.seqs.resize_with(n, SeqBuf::default);
        }
        for s in &mut self.seqs[..n] {
            s.seq = r.u64()?;
            s.max_draft = r.u32()? as usize;
            s.params = SamplingParams {
                temperature: r.f32()?,
                top_k: r.u32()? as usize,
                top_p: r.f32()?,
                min_p: r.f32()?,
                seed: r.u64()?,
                ..SamplingParams::default()
            };
            s.hidden_start = r.u64()? as usize;
            r.u32s_into(&mut s.tokens)?;
            let layers = r.u32()? as usize;
            if layers > 8 {
                return Err(format!("plugin host: {layers} hidden layers"));
            }
            s.hidden.resize_with(layers, Default::default);
            for (l, v) in &mut s.hidden {
                *l = r.u32()? as usize;
                r.f32s_into(v)?;
            }
        }
        let batch: Vec<ProposeInput<'_>> = self.seqs[..n]
            .iter()
            .map(|s| ProposeInput {
                seq: s.seq,
                tokens: &s.tokens,
                max_draft: s.max_draft,
                params: &s.params,
                hidden: &s.hidden,
                hidden_start: s.hidden_start,
            })
            .collect();
        // A field borrow (not `self.proposer()`): `batch` borrows `seqs`.
        let p = self.proposer.as_mut().ok_or_else(no_instance)?;
        let drafts = if batch.is_empty() {
            Vec::new()
        } else {
            p.propose(&batch)?
        };
        out.u32(drafts.len() as u32);
        for d in &drafts {
            out.draft(d);
        }
        Ok(())
    }
}

/// Ask the kernel to pick this process first when memory runs out: a
/// plugin that leaks should be what the OOM killer ends (the daemon then
/// restarts it), not the daemon holding the model and every request.
/// Best effort: where /proc is not writable nothing changes.
fn prefer_as_oom_victim() {
    let _ = std::fs::write("/proc/self/oom_score_adj", "1000");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_over_the_frame_limit_becomes_an_error_naming_its_size() {
        let mut out = Writer::default();
        out.u8(wire::REPLY_OK);
        out.buf.extend(std::iter::repeat_n(7u8, 99));
        // At the limit it goes as it is.
        cap_reply(&mut out, 100);
        assert_eq!(out.buf.len(), 100);
        assert_eq!(out.buf[0], wire::REPLY_OK);
        // One byte over: an error the daemon's reader parses.
        out.u8(7);
        cap_reply(&mut out, 100);
        let mut r = Reader::new(&out.buf);
        assert_eq!(r.u8().unwrap(), wire::REPLY_ERR);
        let msg = r.str().unwrap();
        assert!(r.done());
        assert!(
            msg.contains("a 101 byte reply, over the protocol's 100"),
            "{msg}"
        );
    }
}
