//! Process isolation: a proposer whose plugin runs in a child process
//! (`specd plugin-host`), reached over a Unix socket (see `wire`).
//!
//! Invariants:
//! - No call blocks the draft stage past its deadline: a propose exchange
//!   gets `propose_timeout_ms`, starting a child never blocks (it advances
//!   one state per call: spawned, connected, initialised).
//! - A child that crashes, exits, breaks the protocol or misses a deadline
//!   is killed and reaped (the log names its exit status or signal), and a
//!   new one is started after an exponential backoff (100 ms doubling to
//!   30 s; reset after 10 s of health). Meanwhile every sequence gets empty
//!   drafts (plain decoding): nothing is lost and outputs stay lossless.
//! - The daemon keeps each live sequence's tokens, so a new child is
//!   replayed into the same state (`start` with everything committed so
//!   far), within the first exchange's deadline; a replay that misses it
//!   leaves those sequences to plain decoding (replaying them again
//!   would only miss it again, restarting children in a loop). A proposer that needs hidden states cannot be replayed (past
//!   states are gone): its live sequences decode plainly until they end.
//! - A plugin that *reports* an error (rather than dying) is poisoned as in
//!   process: the `Drafter` sees the `Err`.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::instance::TargetDims;
use super::wire::{self, Reader, Writer};
use crate::error::{Result, SpecdError};
use crate::speculative::proposer::{
    Capabilities, Draft, Isolation, ProposeInput, Proposer, ProposerInfo, ProposerState,
};
use crate::speculative::SeqId;

const BACKOFF_START: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
const HEALTHY_RESET: Duration = Duration::from_secs(10);
/// Queued lifecycle commands are flushed once they grow past this.
const QUEUE_FLUSH_BYTES: usize = 8 << 20;

/// How to start the child.
#[derive(Debug, Clone)]
pub struct ProcessSpec {
    /// The proposer's configured name.
    pub name: String,
    /// The `specd` executable (see `plugin_host_exe`).
    pub exe: PathBuf,
    pub library: PathBuf,
    /// The plugin's options, as TOML text.
    pub options: String,
    pub dims: TargetDims,
    /// The target model, loaded by the child only if the plugin calls back
    /// for embeddings, the LM head or token text.
    pub model: Option<PathBuf>,
    pub propose_timeout: Duration,
    /// For a child to connect and create its instance.
    pub init_timeout: Duration,
}

impl ProcessSpec {
    /// The spec of proposer `name`: its plugin `library` and `options`,
    /// for a target of config `target` (whose file, `model`, the child
    /// loads only if the plugin calls back for it), with a propose
    /// deadline of `propose_timeout_ms`.
    pub fn new(
        name: &str,
        library: &std::path::Path,
        options: &toml::Table,
        target: &crate::model::ModelConfig,
        model: Option<PathBuf>,
        propose_timeout_ms: u64,
    ) -> Result<Self> {
        Ok(Self {
            name: name.to_string(),
            exe: plugin_host_exe()?,
            library: library.canonicalize().map_err(|e| {
                SpecdError::Plugin(format!(
                    "proposer `{name}`: {}: cannot open: {e}",
                    library.display()
                ))
            })?,
            options: toml::to_string(options)
                .map_err(|e| SpecdError::Plugin(format!("proposer `{name}`: options: {e}")))?,
            dims: TargetDims::of(target),
            model,
            propose_timeout: Duration::from_millis(propose_timeout_ms),
            init_timeout: Duration::from_secs(30),
        })
    }
}

/// The `specd` binary to run as a plugin host: `$SPECD_PLUGIN_HOST`, the
/// running executable if it is `specd`, else a `specd` beside it or in
/// its parent directory (test binaries live in `target/<profile>/deps`).
pub fn plugin_host_exe() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("SPECD_PLUGIN_HOST") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()
        .map_err(|e| SpecdError::Plugin(format!("process isolation: current executable: {e}")))?;
    let bin = format!("specd{}", std::env::consts::EXE_SUFFIX);
    if exe.file_name().is_some_and(|n| n == bin.as_str()) {
        return Ok(exe);
    }
    let mut dir = exe.parent();
    for _ in 0..2 {
        let Some(d) = dir else { break };
        let p = d.join(&bin);
        if p.is_file() {
            return Ok(p);
        }
        dir = d.parent();
    }
    Err(SpecdError::Plugin(format!(
        "process isolation needs the `specd` binary as its plugin host: none beside {} (set SPECD_PLUGIN_HOST)",
        exe.display()
    )))
}

enum Conn {
    /// No child; the next one may start at `until`.
    Down { until: Instant },
    Connecting {
        child: Child,
        listener: UnixListener,
        sock: PathBuf,
        since: Instant,
    },
    Initializing {
        child: Child,
        stream: UnixStream,
        since: Instant,
        /// The init reply's bytes so far (read without blocking).
        got: Vec<u8>,
    },
    Up {
        child: Child,
        stream: UnixStream,
        since: Instant,
    },
}

/// Why a child was given up.
enum Failure {
    Timeout(&'static str),
    Died(String),
    Protocol(String),
}

/// Largest init reply accepted (capabilities and a few names).
const MAX_INIT_REPLY: usize = 1 << 20;

/// A proposer served by a plugin-host child process.
pub struct ProcessProposer {
    spec: ProcessSpec,
    caps: Capabilities,
    info: ProposerInfo,
    conn: Conn,
    backoff: Duration,
    /// When the current outage began (for the recovery time).
    outage: Option<Instant>,
    /// Every live sequence's tokens (prompt and committed).
    live: HashMap<SeqId, Vec<u32>>,
    /// Live sequences a new child could not be replayed into.
    orphans: HashSet<SeqId>,
    /// The sequences the queued commands replay into a new child.
    replaying: Vec<SeqId>,
    /// Lifecycle commands waiting for the next exchange.
    queued: Writer,
    reply: Vec<u8>,
    /// The library file as the running child found it, and as the child
    /// being started did (a file rebuilt since is loaded by a reload).
    loaded: Option<super::library::FileId>,
    starting: Option<super::library::FileId>,
}

impl std::fmt::Debug for ProcessProposer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessProposer")
            .field("name", &self.spec.name)
            .field("library", &self.spec.library)
            .finish()
    }
}

/// Remove this process's socket directory (at shutdown).
pub fn remove_socket_dir() {
    let _ = std::fs::remove_dir_all(socket_dir());
}

fn socket_dir() -> PathBuf {
    std::env::temp_dir().join(format!("specd-{}-plugin-hosts", std::process::id()))
}

/// A fresh socket path in this daemon's private directory (mode 0700, so
/// no other user can connect in the child's place).
fn socket_path(name: &str) -> std::io::Result<PathBuf> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = socket_dir();
    super::library::private_dir(&dir)?;
    let clean: String = name
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(16)
        .collect();
    Ok(dir.join(format!(
        "{clean}-{}.sock",
        N.fetch_add(1, Ordering::Relaxed)
    )))
}

/// An exit status in words: the signal's name when it was killed.
pub fn describe_status(s: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(sig) = s.signal() {
        let name = match sig {
            4 => "SIGILL",
            6 => "SIGABRT",
            7 => "SIGBUS",
            8 => "SIGFPE",
            9 => "SIGKILL",
            11 => "SIGSEGV",
            15 => "SIGTERM",
            _ => "signal",
        };
        return format!("killed by signal {sig} ({name})");
    }
    match s.code() {
        Some(c) => format!("exited with status {c}"),
        None => "ended".into(),
    }
}

fn spawn(spec: &ProcessSpec) -> std::io::Result<(Child, UnixListener, PathBuf)> {
    let sock = socket_path(&spec.name)?;
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock)?;
    listener.set_nonblocking(true)?;
    let child = Command::new(&spec.exe)
        .arg("plugin-host")
        .arg("--socket")
        .arg(&sock)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&sock);
        })?;
    Ok((child, listener, sock))
}

impl ProcessProposer {
    /// Start the child and create the instance, waiting for both (up to
    /// `init_timeout`): a plugin that cannot start fails here, as it would
    /// in process.
    pub fn spawn(spec: ProcessSpec) -> Result<Self> {
        let name = spec.name.clone();
        let err = |why: String| {
            SpecdError::Plugin(format!(
                "proposer `{name}` (isolation = \"process\", {}): {why}",
                spec.library.display()
            ))
        };
        let loaded = super::library::file_id(&spec.library);
        let (mut child, listener, sock) =
            spawn(&spec).map_err(|e| err(format!("starting {}: {e}", spec.exe.display())))?;
        let deadline = Instant::now() + spec.init_timeout;
        let stream = loop {
            match listener.accept() {
                Ok((s, _)) => break Ok(s),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => break Err(format!("accepting the plugin host: {e}")),
            }
            if let Ok(Some(st)) = child.try_wait() {
                break Err(format!("the plugin host {}", describe_status(&st)));
            }
            if Instant::now() >= deadline {
                break Err("the plugin host did not connect in time".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let _ = std::fs::remove_file(&sock);
        let mut stream = match stream {
            Ok(s) => s,
            Err(why) => {
                kill(child);
                return Err(err(why));
            }
        };
        let mut w = Writer::default();
        init_frame(&spec, &mut w);
        let mut reply = Vec::new();
        let res = stream
            .set_nonblocking(false)
            .map_err(|e| Failure::Protocol(e.to_string()))
            .and_then(|_| exchange(&mut stream, &w.buf, &mut reply, spec.init_timeout))
            .and_then(|_| parse_init(&reply));
        let (caps, mut info) = match res {
            Ok(x) => x,
            Err(f) => {
                let status = kill(child);
                return Err(err(match f {
                    Failure::Protocol(m) => m,
                    Failure::Timeout(what) => format!("{what} timed out"),
                    Failure::Died(m) => format!("the plugin host {m} ({status})"),
                }));
            }
        };
        if let Err(why) = super::instance::check_caps(&spec.name, &caps, spec.dims) {
            kill(child);
            return Err(err(why));
        }
        info.path = Some(spec.library.display().to_string());
        metrics::gauge!("specd_proposer_up", "proposer" => name.clone()).set(1.0);
        Ok(Self {
            spec,
            caps,
            info,
            conn: Conn::Up {
                child,
                stream,
                since: Instant::now(),
            },
            backoff: BACKOFF_START,
            outage: None,
            live: HashMap::new(),
            orphans: HashSet::new(),
            replaying: Vec::new(),
            queued: Writer::default(),
            reply,
            loaded,
            starting: loaded,
        })
    }

    fn is_up(&self) -> bool {
        matches!(self.conn, Conn::Up { .. })
    }

    /// Give the child up: kill and reap it, log why, count it, and wait
    /// out the backoff before the next one.
    fn fail(&mut self, f: Failure) {
        let now = Instant::now();
        let conn = std::mem::replace(&mut self.conn, Conn::Down { until: now });
        let (child, sock) = match conn {
            Conn::Down { .. } => return,
            Conn::Connecting { child, sock, .. } => (child, Some(sock)),
            Conn::Initializing { child, .. } | Conn::Up { child, .. } => (child, None),
        };
        if let Some(s) = sock {
            let _ = std::fs::remove_file(s);
        }
        let pid = child.id();
        let status = kill(child);
        self.record_failure(f, Some(pid), &status);
    }

    fn record_failure(&mut self, f: Failure, pid: Option<u32>, status: &str) {
        let now = Instant::now();
        let name = self.spec.name.clone();
        let why = match &f {
            Failure::Timeout(what) => {
                metrics::counter!("specd_proposer_timeouts_total", "proposer" => name.clone())
                    .increment(1);
                self.info.timeouts += 1;
                let ms = match *what {
                    "propose" | "replay" => self.spec.propose_timeout,
                    _ => self.spec.init_timeout,
                }
                .as_millis();
                format!("{what} missed its deadline of {ms} ms; the plugin host was {status}")
            }
            Failure::Died(m) => {
                metrics::counter!("specd_proposer_crashes_total", "proposer" => name.clone())
                    .increment(1);
                self.info.crashes += 1;
                format!("the plugin host {m}: {status}")
            }
            Failure::Protocol(m) => {
                metrics::counter!("specd_proposer_crashes_total", "proposer" => name.clone())
                    .increment(1);
                self.info.crashes += 1;
                format!("protocol error ({m}); the plugin host was {status}")
            }
        };
        tracing::warn!(
            proposer = %name,
            pid,
            retry_in_ms = self.backoff.as_millis() as u64,
            "{why}; its sequences decode without speculation until a new plugin host is up"
        );
        metrics::gauge!("specd_proposer_up", "proposer" => name).set(0.0);
        self.info.last_failure = Some(why);
        self.info.state = ProposerState::Restarting;
        self.info.pid = None;
        self.conn = Conn::Down {
            until: now + self.backoff,
        };
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
        self.outage.get_or_insert(now);
        self.queued.clear();
        if !self.caps.hidden_layers.is_empty() {
            self.orphans.extend(self.live.keys().copied());
        }
    }

    /// Advance a restart by at most one state without blocking.
    fn poll(&mut self) {
        let now = Instant::now();
        let conn = std::mem::replace(&mut self.conn, Conn::Down { until: now });
        self.conn = match conn {
            Conn::Down { until } if now < until => Conn::Down { until },
            Conn::Down { .. } => {
                self.starting = super::library::file_id(&self.spec.library);
                match spawn(&self.spec) {
                    Ok((child, listener, sock)) => Conn::Connecting {
                        child,
                        listener,
                        sock,
                        since: now,
                    },
                    Err(e) => {
                        return self.record_failure(
                            Failure::Died(format!("could not be started ({e})")),
                            None,
                            "no process",
                        );
                    }
                }
            }
            Conn::Connecting {
                mut child,
                listener,
                sock,
                since,
            } => match listener.accept() {
                Ok((mut stream, _)) => {
                    let _ = std::fs::remove_file(&sock);
                    let mut w = Writer::default();
                    init_frame(&self.spec, &mut w);
                    let sent = stream.set_nonblocking(false).is_ok()
                        && stream
                            .set_write_timeout(Some(self.spec.init_timeout))
                            .is_ok()
                        && wire::write_frame(&mut stream, &w.buf).is_ok();
                    let sent = sent && stream.set_nonblocking(true).is_ok();
                    self.conn = Conn::Initializing {
                        child,
                        stream,
                        since,
                        got: Vec::new(),
                    };
                    if !sent {
                        self.fail(Failure::Died("hung up during init".into()));
                    }
                    return;
                }
                Err(_) => {
                    let exited = matches!(child.try_wait(), Ok(Some(_)));
                    self.conn = Conn::Connecting {
                        child,
                        listener,
                        sock,
                        since,
                    };
                    if exited {
                        self.fail(Failure::Died("exited before connecting".into()));
                    } else if now - since > self.spec.init_timeout {
                        self.fail(Failure::Timeout("connecting"));
                    }
                    return;
                }
            },
            Conn::Initializing {
                child,
                mut stream,
                since,
                mut got,
            } => {
                let mut hung_up = false;
                let mut chunk = [0u8; 4096];
                // Up to one whole init reply: a child that floods the
                // socket is not read past `MAX_INIT_REPLY`.
                while got.len() <= MAX_INIT_REPLY + 4 {
                    match stream.read(&mut chunk) {
                        Ok(0) => {
                            hung_up = true;
                            break;
                        }
                        Ok(n) => got.extend_from_slice(&chunk[..n]),
                        Err(_) => break,
                    }
                }
                let len = got
                    .get(..4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
                let complete = len.filter(|&n| got.len() >= 4 + n);
                let ok = complete.is_some() && stream.set_nonblocking(false).is_ok();
                self.conn = Conn::Initializing {
                    child,
                    stream,
                    since,
                    got: Vec::new(),
                };
                match complete {
                    Some(n) if ok => match parse_init(&got[4..4 + n]) {
                        // The engine plans, validates and accepts by the
                        // first child's declaration (sibling draws, q
                        // kind): a replacement must declare the same.
                        Ok((caps, info)) if caps == self.caps => self.came_up(info),
                        Ok(_) => self.fail(Failure::Protocol(
                            "the restarted plugin host declares other capabilities than the first \
                             (was the library replaced?); restart the daemon to load a new one"
                                .into(),
                        )),
                        Err(f) => self.fail(f),
                    },
                    _ if hung_up => self.fail(Failure::Died("hung up during init".into())),
                    Some(_) => self.fail(Failure::Died("socket error during init".into())),
                    None if len.is_some_and(|n| n > MAX_INIT_REPLY) => {
                        self.fail(Failure::Protocol("oversized init reply".into()))
                    }
                    None if now - since > self.spec.init_timeout => {
                        self.fail(Failure::Timeout("init"))
                    }
                    None => {
                        if let Conn::Initializing { got: g, .. } = &mut self.conn {
                            *g = got;
                        }
                    }
                }
                return;
            }
            Conn::Up {
                child,
                stream,
                since,
            } => {
                if now - since > HEALTHY_RESET {
                    self.backoff = BACKOFF_START;
                }
                Conn::Up {
                    child,
                    stream,
                    since,
                }
            }
        };
    }

    /// A restarted child answered its init: replay the live sequences.
    fn came_up(&mut self, info: ProposerInfo) {
        let Conn::Initializing {
            child,
            stream,
            since: spawned,
            ..
        } = std::mem::replace(
            &mut self.conn,
            Conn::Down {
                until: Instant::now(),
            },
        )
        else {
            return;
        };
        let now = Instant::now();
        let recovery = self.outage.take().map(|t| now - t);
        self.info.last_start_ms = Some((now - spawned).as_secs_f64() * 1e3);
        self.info.pid = info.pid;
        self.info.state = ProposerState::Healthy;
        self.info.restarts += 1;
        // A restart loads the library file as it is now (a rebuilt one
        // declaring the same capabilities): list what the child runs.
        self.loaded = self.starting;
        self.info.plugin = info.plugin;
        self.info.version = info.version;
        self.info.build_id = info.build_id;
        self.info.last_recovery_ms = recovery.map(|d| d.as_secs_f64() * 1e3);
        metrics::counter!("specd_proposer_restarts_total", "proposer" => self.spec.name.clone())
            .increment(1);
        metrics::gauge!("specd_proposer_up", "proposer" => self.spec.name.clone()).set(1.0);
        tracing::info!(
            proposer = %self.spec.name,
            pid = info.pid,
            recovery_ms = self.info.last_recovery_ms,
            start_ms = self.info.last_start_ms,
            replayed = self.live.len() - self.orphans.len(),
            "plugin host restarted"
        );
        let mut seqs: Vec<&SeqId> = self.live.keys().collect();
        seqs.sort();
        self.queued.clear();
        for &seq in seqs {
            if !self.orphans.contains(&seq) {
                self.queued.u8(wire::CMD_START);
                self.queued.u64(seq);
                self.queued.u32s(&self.live[&seq]);
                self.replaying.push(seq);
            }
        }
        self.conn = Conn::Up {
            child,
            stream,
            since: now,
        };
    }

    /// Send the queued commands followed by whatever `tail` appends.
    /// `Ok(true)`: the answer follows the status byte in `self.reply`;
    /// `Ok(false)`: no child answered (it was given up); `Err`: the plugin
    /// reported an error.
    fn call(&mut self, tail: impl FnOnce(&mut Writer)) -> std::result::Result<bool, String> {
        tail(&mut self.queued);
        let replaying = std::mem::take(&mut self.replaying);
        let Conn::Up { stream, .. } = &mut self.conn else {
            self.queued.clear();
            return Ok(false);
        };
        let res = exchange(
            stream,
            &self.queued.buf,
            &mut self.reply,
            self.spec.propose_timeout,
        );
        self.queued.clear();
        match res {
            Ok(()) => match self.reply.first() {
                Some(&wire::REPLY_OK) => Ok(true),
                Some(&wire::REPLY_ERR) => {
                    let mut r = Reader::new(&self.reply[1..]);
                    Err(r.str().unwrap_or_else(|e| e))
                }
                _ => {
                    self.fail(Failure::Protocol("empty reply".into()));
                    Ok(false)
                }
            },
            Err(Failure::Timeout(_)) if !replaying.is_empty() => {
                // The replay alone outlasts the deadline (long sequences,
                // a slow `start`): every later child would time out on it
                // again. The sequences it carried decode plainly until
                // they end; new ones draft as before.
                let n = replaying.len();
                self.orphans
                    .extend(replaying.into_iter().filter(|s| self.live.contains_key(s)));
                tracing::warn!(
                    proposer = %self.spec.name,
                    sequences = n,
                    "replaying the live sequences into the new plugin host missed the deadline; they decode without speculation"
                );
                self.fail(Failure::Timeout("replay"));
                Ok(false)
            }
            Err(f) => {
                self.fail(f);
                Ok(false)
            }
        }
    }

    /// Flush queued commands when they pile up between proposes.
    fn maybe_flush(&mut self) -> std::result::Result<(), String> {
        if self.queued.buf.len() > QUEUE_FLUSH_BYTES {
            self.call(|w| {
                w.u8(wire::CMD_PROPOSE);
                w.u32(0);
            })?;
        }
        Ok(())
    }
}

/// Kill (if still running) and reap `child`; its status in words. Never
/// blocks the caller (the draft stage) for long: a child that has not
/// exited 100 ms after SIGKILL (stuck in the kernel, say) is reaped by a
/// thread of its own.
fn kill(mut child: Child) -> String {
    let _ = child.kill();
    let deadline = Instant::now() + Duration::from_millis(100);
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return describe_status(&s),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
            Ok(None) => {
                let pid = child.id();
                let _ = std::thread::Builder::new()
                    .name(format!("specd-reap-{pid}"))
                    .spawn(move || child.wait());
                return "killed, not yet exited".into();
            }
            Err(e) => return format!("status unknown ({e})"),
        }
    }
}

fn init_frame(spec: &ProcessSpec, w: &mut Writer) {
    w.u8(wire::CMD_INIT);
    w.str(&spec.name);
    w.str(&spec.library.to_string_lossy());
    w.str(&spec.options);
    w.u32(spec.dims.vocab as u32);
    w.u32(spec.dims.hidden as u32);
    w.u32(spec.dims.layers as u32);
    w.str(
        &spec
            .model
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
}

fn parse_init(reply: &[u8]) -> std::result::Result<(Capabilities, ProposerInfo), Failure> {
    let mut r = Reader::new(reply);
    let proto = |e: String| Failure::Protocol(e);
    match r.u8().map_err(proto)? {
        wire::REPLY_OK => {}
        _ => return Err(Failure::Protocol(r.str().map_err(proto)?)),
    }
    let caps = r.caps().map_err(proto)?;
    let info = ProposerInfo {
        plugin: r.str().map_err(proto)?,
        version: r.str().map_err(proto)?,
        build_id: r.str().map_err(proto)?,
        pid: Some(r.u32().map_err(proto)?),
        isolation: Isolation::Process,
        ..ProposerInfo::default()
    };
    Ok((caps, info))
}

/// One request frame and its reply within `timeout`.
fn exchange(
    stream: &mut UnixStream,
    payload: &[u8],
    reply: &mut Vec<u8>,
    timeout: Duration,
) -> std::result::Result<(), Failure> {
    let deadline = Instant::now() + timeout;
    let io = |e: std::io::Error, what: &'static str| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Failure::Timeout(what),
        _ => Failure::Died(format!("hung up ({e})")),
    };
    let mut s = ByDeadline { stream, deadline };
    wire::write_frame(&mut s, payload).map_err(|e| io(e, "propose"))?;
    read_reply(&mut s, reply)
}

/// A socket whose reads and writes all end by one deadline. A socket
/// timeout alone restarts with every call: a child trickling a byte at a
/// time would hold the engine forever.
struct ByDeadline<'a> {
    stream: &'a mut UnixStream,
    deadline: Instant,
}

impl ByDeadline<'_> {
    fn left(&self) -> std::io::Result<Duration> {
        match self.deadline.saturating_duration_since(Instant::now()) {
            d if d.is_zero() => Err(std::io::ErrorKind::TimedOut.into()),
            d => Ok(d),
        }
    }
}

impl Read for ByDeadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.left()?;
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

impl Write for ByDeadline<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let left = self.left()?;
        self.stream.set_write_timeout(Some(left))?;
        self.stream.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

fn read_reply(s: &mut ByDeadline<'_>, reply: &mut Vec<u8>) -> std::result::Result<(), Failure> {
    match wire::read_frame(s, reply) {
        Ok(true) => Ok(()),
        Ok(false) => Err(Failure::Died("hung up".into())),
        Err(e) => match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                Err(Failure::Timeout("propose"))
            }
            std::io::ErrorKind::InvalidData => Err(Failure::Protocol(e.to_string())),
            _ => Err(Failure::Died(format!("hung up ({e})"))),
        },
    }
}

impl Drop for ProcessProposer {
    fn drop(&mut self) {
        match std::mem::replace(
            &mut self.conn,
            Conn::Down {
                until: Instant::now(),
            },
        ) {
            Conn::Down { .. } => {}
            Conn::Connecting { child, sock, .. } => {
                let _ = std::fs::remove_file(sock);
                kill(child);
            }
            Conn::Initializing { child, .. } | Conn::Up { child, .. } => {
                kill(child);
            }
        }
        // Removed once empty (the last isolated proposer gone).
        let _ = std::fs::remove_dir(socket_dir());
    }
}

impl Proposer for ProcessProposer {
    fn name(&self) -> &str {
        &self.spec.name
    }

    fn capabilities(&self) -> Capabilities {
        self.caps.clone()
    }

    fn info(&self) -> ProposerInfo {
        ProposerInfo {
            // The child answered for the file it loaded; this side sees
            // whether the file was replaced since.
            library_rebuilt: super::library::file_id(&self.spec.library) != self.loaded,
            ..self.info.clone()
        }
    }

    fn start(&mut self, seq: SeqId, prompt: &[u32]) -> std::result::Result<(), String> {
        self.live.insert(seq, prompt.to_vec());
        self.orphans.remove(&seq);
        if !self.is_up() && !self.caps.hidden_layers.is_empty() {
            // Its prompt's hidden states go by while no child takes them:
            // a later child could not be given them.
            self.orphans.insert(seq);
        }
        if self.is_up() {
            self.queued.u8(wire::CMD_START);
            self.queued.u64(seq);
            self.queued.u32s(prompt);
        }
        self.maybe_flush()
    }

    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> std::result::Result<Vec<Draft>, String> {
        self.poll();
        let mut out = vec![Draft::default(); batch.len()];
        let asked: Vec<usize> = (0..batch.len())
            .filter(|&i| !self.orphans.contains(&batch[i].seq))
            .collect();
        if !self.is_up() || asked.is_empty() {
            return Ok(out);
        }
        let got = self.call(|w| {
            w.u8(wire::CMD_PROPOSE);
            w.u32(asked.len() as u32);
            for &i in &asked {
                let b = &batch[i];
                w.u64(b.seq);
                w.u32(b.max_draft as u32);
                w.f32(b.params.temperature);
                w.u32(b.params.top_k as u32);
                w.f32(b.params.top_p);
                w.f32(b.params.min_p);
                w.u64(b.params.seed);
                w.u64(b.hidden_start as u64);
                w.u32s(b.tokens);
                w.u32(b.hidden.len() as u32);
                for (l, v) in b.hidden {
                    w.u32(*l as u32);
                    w.f32s(v);
                }
            }
        })?;
        if !got {
            return Ok(out);
        }
        let mut r = Reader::new(&self.reply[1..]);
        let parsed: std::result::Result<Vec<Draft>, String> = (|| {
            let n = r.u32()? as usize;
            if n != asked.len() {
                return Err(format!("{n} drafts for {} sequences", asked.len()));
            }
            asked.iter().map(|&i| r.draft(batch[i].max_draft)).collect()
        })();
        match parsed {
            Ok(drafts) => {
                for (i, d) in asked.into_iter().zip(drafts) {
                    out[i] = d;
                }
            }
            Err(e) => self.fail(Failure::Protocol(e)),
        }
        Ok(out)
    }

    fn observe(
        &mut self,
        seq: SeqId,
        committed: &[u32],
        path: &[usize],
    ) -> std::result::Result<(), String> {
        if let Some(t) = self.live.get_mut(&seq) {
            t.extend_from_slice(committed);
        }
        if self.is_up() && !self.orphans.contains(&seq) {
            self.queued.u8(wire::CMD_OBSERVE);
            self.queued.u64(seq);
            self.queued.u32s(committed);
            let p: Vec<u32> = path.iter().map(|&x| x as u32).collect();
            self.queued.u32s(&p);
        }
        self.maybe_flush()
    }

    fn finish(&mut self, seq: SeqId) {
        self.live.remove(&seq);
        let orphan = self.orphans.remove(&seq);
        if self.is_up() && !orphan {
            self.queued.u8(wire::CMD_FINISH);
            self.queued.u64(seq);
        }
        if let Err(e) = self.maybe_flush() {
            tracing::warn!(proposer = %self.spec.name, "finish: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A proposer whose child is down (for a minute), declaring `caps`.
    fn down(caps: Capabilities) -> ProcessProposer {
        ProcessProposer {
            spec: ProcessSpec {
                name: "down".into(),
                exe: PathBuf::from("/nonexistent"),
                library: PathBuf::from("/nonexistent"),
                options: String::new(),
                dims: TargetDims::default(),
                model: None,
                propose_timeout: Duration::from_millis(100),
                init_timeout: Duration::from_millis(100),
            },
            caps,
            info: ProposerInfo::default(),
            conn: Conn::Down {
                until: Instant::now() + Duration::from_secs(60),
            },
            backoff: BACKOFF_START,
            outage: Some(Instant::now()),
            live: HashMap::new(),
            orphans: HashSet::new(),
            replaying: Vec::new(),
            queued: Writer::default(),
            reply: Vec::new(),
            loaded: None,
            starting: None,
        }
    }

    /// A sequence that starts while no child is up cannot be replayed into
    /// a hidden-state proposer (its prompt's states were never delivered):
    /// it stays plain; a token-only proposer replays it.
    #[test]
    fn a_sequence_started_during_an_outage_is_replayed_only_without_hidden_states() {
        let hidden = Capabilities {
            hidden_layers: vec![3],
            ..Capabilities::default()
        };
        for (caps, orphaned) in [(hidden, true), (Capabilities::default(), false)] {
            let mut p = down(caps);
            p.start(7, &[1, 2, 3]).unwrap();
            assert_eq!(p.orphans.contains(&7), orphaned);
            assert_eq!(p.live[&7], vec![1, 2, 3]);
            p.finish(7);
            assert!(p.live.is_empty() && p.orphans.is_empty());
        }
    }

    #[test]
    fn a_reply_trickled_a_byte_at_a_time_times_out_by_the_deadline() {
        // Each read would get the full socket timeout again; the exchange
        // as a whole must still end at its deadline.
        let (mut ours, mut child) = UnixStream::pair().unwrap();
        let trickle = std::thread::spawn(move || {
            let mut req = Vec::new();
            let _ = wire::read_frame(&mut child, &mut req);
            let _ = child.write_all(&1000u32.to_le_bytes());
            for _ in 0..40 {
                std::thread::sleep(Duration::from_millis(50));
                if child.write_all(&[0]).is_err() {
                    break;
                }
            }
        });
        let t = Instant::now();
        let mut reply = Vec::new();
        let r = exchange(&mut ours, b"ping", &mut reply, Duration::from_millis(300));
        let took = t.elapsed();
        assert!(
            matches!(r, Err(Failure::Timeout(_))),
            "{:?}",
            r.err().map(|_| ())
        );
        assert!(took < Duration::from_millis(1500), "took {took:?}");
        drop(ours);
        trickle.join().unwrap();
    }
}
