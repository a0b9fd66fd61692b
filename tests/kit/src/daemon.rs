//! A `specd serve` child on a free port and a minimal HTTP client.

use super::*;

/// A `specd serve` child process on a free loopback port.
pub struct Daemon {
    pub child: std::process::Child,
    pub addr: String,
    pub stderr: std::sync::Arc<std::sync::Mutex<String>>,
    _dir: TempDir,
}

impl Daemon {
    /// Start with `config` (TOML text) on 127.0.0.1, any free port.
    pub fn start(config: &str, envs: &[(&str, &str)]) -> Self {
        use std::io::BufRead;
        smollm_path();
        let dir = TempDir::new("daemon");
        let cfg = dir.0.join("specd.toml");
        std::fs::write(&cfg, config).unwrap();
        let mut cmd = std::process::Command::new(specd_bin());
        cmd.args([
            "serve",
            "--config",
            cfg.to_str().unwrap(),
            "--port",
            "0",
            "--threads",
            "2",
        ])
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
                }
                log2.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let addr = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("daemon did not start: {}", log.lock().unwrap()));
        Self {
            child,
            addr,
            stderr: log,
            _dir: dir,
        }
    }

    /// The config file the daemon was started with (a test may rewrite it
    /// and ask for a reload).
    pub fn config_path(&self) -> PathBuf {
        self._dir.0.join("specd.toml")
    }

    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> HttpResponse {
        http(&self.addr, method, path, body, headers)
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> HttpResponse {
        self.request("POST", path, Some(&body.to_string()), &[])
    }

    /// Sum of a metric's samples (all label sets) in /metrics.
    pub fn metric(&self, name: &str) -> f64 {
        self.metric_where(name, "")
    }

    /// Sum of a metric's samples whose line contains `needle` (e.g. a label).
    pub fn metric_where(&self, name: &str, needle: &str) -> f64 {
        let m = self.request("GET", "/metrics", None, &[]).body;
        m.lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| l.split(['{', ' ']).next() == Some(name))
            .filter(|l| l.contains(needle))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .sum()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl HttpResponse {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The JSON payloads of an SSE body (`data: ...` lines, `[DONE]` excluded).
    pub fn sse(&self) -> Vec<serde_json::Value> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }
}

/// Minimal blocking HTTP/1.1 client (loopback tests only).
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> HttpResponse {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(300)))
        .unwrap();
    let body = body.unwrap_or("");
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    HttpResponse {
        status,
        headers: head.to_string(),
        body,
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}
