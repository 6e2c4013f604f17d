//! `server`: asking a running vramguard whether it is ready, whether its admin endpoints accept
//! this client and what its `/status` says, then judging the answers. Nothing running is a
//! warning, not a failure: doctor also runs before the first start.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use serde_json::{Value, json};

use super::client::{self, Failure, Response};
use super::{Check, Status};
use crate::config::Config;
use crate::core::snapshot::BreakerState;
use crate::protocol::status::{PoolAvailability, StatusReport};

/// Whether doctor has the admin token the config names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Token {
    /// The config names no `server.admin_token_env`: admin is on the socket only.
    NotConfigured,
    /// The config names this variable, but it is unset or empty here.
    Unset(String),
    /// The variable is set; its value is sent as the bearer token.
    Set(String, String),
}

/// What asking the running server gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerProbe {
    /// No address to ask (a bad `--url`, or `server.listen` with port 0).
    NoAddress(String),
    /// The address did not answer.
    Unreachable {
        /// The base URL.
        url: String,
        /// Why.
        failure: Failure,
    },
    /// A server answered.
    Answered {
        /// The base URL.
        url: String,
        /// `GET /v2/health/ready`.
        ready: Response,
        /// `GET /admin` with the token, if any.
        admin: Result<Response, Failure>,
        /// `GET /status`.
        status: Result<Response, Failure>,
        /// The token situation.
        token: Token,
    },
}

impl ServerProbe {
    /// The server's `/status` document, when it gave one, or why it could not be read (a
    /// server of another version may write another document).
    pub(super) fn status(&self) -> Option<Result<StatusReport, String>> {
        match self {
            ServerProbe::Answered { status: Ok(r), .. } if r.status == 200 => {
                Some(serde_json::from_str(&r.body).map_err(|e| e.to_string()))
            }
            _ => None,
        }
    }
}

/// The address a local client reaches `listen` at: unspecified addresses (`0.0.0.0`, `::`)
/// through loopback.
pub(super) fn client_url(listen: SocketAddr) -> Result<String, String> {
    if listen.port() == 0 {
        return Err(format!(
            "server.listen is {listen}: the port is chosen at start, so pass --url"
        ));
    }
    let ip = match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    Ok(format!("http://{}", SocketAddr::new(ip, listen.port())))
}

/// Ask the server at `url` (the config's `server.listen` without one).
pub(super) fn probe_server(url: Option<&str>, config: Option<&Config>) -> ServerProbe {
    // An invalid config has no address of its own: the embedded default's is the best guess.
    let listen = config.map_or_else(|| Config::embedded(false).server.listen, |c| c.server.listen);
    let url = match url.map_or_else(|| client_url(listen), |u| Ok(u.to_string())) {
        Ok(url) => url,
        Err(reason) => return ServerProbe::NoAddress(reason),
    };
    let url = match client::base_url(&url) {
        Ok(url) => url,
        Err(reason) => return ServerProbe::NoAddress(reason),
    };
    let token = match config.and_then(|c| c.server.admin_token_env.clone()) {
        None => Token::NotConfigured,
        Some(var) => match std::env::var(&var) {
            Ok(value) if !value.trim().is_empty() => Token::Set(var, value),
            _ => Token::Unset(var),
        },
    };
    let ready = match client::get(&url, "/v2/health/ready", None) {
        Ok(ready) => ready,
        Err(failure) => return ServerProbe::Unreachable { url, failure },
    };
    let bearer = match &token {
        Token::Set(_, value) => Some(value.as_str()),
        _ => None,
    };
    // The admin socket when this host has it (the default way in), else TCP with the token.
    let socket = config.and_then(|c| c.server.admin_socket.path().map(std::path::Path::to_path_buf));
    let admin = match socket.filter(|s| s.exists()) {
        Some(socket) => client::get_unix(&socket, "/admin"),
        None => client::get(&url, "/admin", bearer),
    };
    let status = client::get(&url, "/status", None);
    ServerProbe::Answered {
        url,
        ready,
        admin,
        status,
        token,
    }
}

/// The `error` of a JSON error body, or the start of the body.
fn error_of(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_string))
        .unwrap_or_else(|| body.trim().chars().take(200).collect())
}

/// What the answers showed: the worst verdict so far, a line for each finding, the fixes.
struct Findings {
    worst: Status,
    lines: Vec<String>,
    fixes: Vec<String>,
}

impl Findings {
    fn note(&mut self, status: Status, line: String) {
        self.worst = self.worst.max(status);
        self.lines.push(line);
    }
}

/// `server`: a running vramguard is ready and its admin endpoints accept this client.
pub fn check_server(probe: &ServerProbe) -> Check {
    match probe {
        ServerProbe::NoAddress(reason) => Check::new("server", Status::Warn, format!("not checked: {reason}"))
            .fix("pass --url http://HOST:PORT of the running server")
            .data(json!({"running": null, "reason": reason})),
        ServerProbe::Unreachable { url, failure } => unreachable_at(url, failure),
        ServerProbe::Answered {
            url,
            ready,
            admin,
            token,
            ..
        } => answered(url, ready, probe.status(), admin, token),
    }
}

/// Nothing answering at `url`: not running (a warning), or not answering as a server should.
fn unreachable_at(url: &str, failure: &Failure) -> Check {
    match failure {
        Failure::NotListening(e) => Check::new(
            "server",
            Status::Warn,
            format!("nothing answers at {url}: vramguard is not running there"),
        )
        .detail(e.clone())
        .fix("start it (`vramguard serve`, or `systemctl start vramguard`), or pass --url where it runs")
        .data(json!({"url": url, "running": false, "error": e})),
        Failure::Other(e) => Check::new("server", Status::Fail, format!("{url} does not answer: {e}"))
            .fix("check that vramguard (and not another program) listens there and is not hung; its log says more")
            .data(json!({"url": url, "running": null, "error": e})),
    }
}

/// A server answered: its readiness, its `/status`, its admin endpoints.
fn answered(
    url: &str,
    ready: &Response,
    status: Option<Result<StatusReport, String>>,
    admin: &Result<Response, Failure>,
    token: &Token,
) -> Check {
    let mut found = Findings {
        worst: Status::Ok,
        lines: Vec::new(),
        fixes: Vec::new(),
    };
    let is_ready = ready.status == 200;
    if !is_ready {
        found.note(
            Status::Fail,
            format!("not ready ({}): {}", ready.status, error_of(&ready.body)),
        );
        found
            .fixes
            .push("see /status for each pool's state and reason".to_string());
    }
    let status = match status {
        Some(Ok(doc)) => Some(doc),
        Some(Err(e)) => {
            found.note(
                Status::Warn,
                format!("its /status could not be read ({e}): a server of another version than this doctor?"),
            );
            None
        }
        None => None,
    };
    if let Some(doc) = &status {
        read_status(doc, &mut found);
    }
    let admin_result = read_admin(admin, token, &mut found);
    let summary = match (is_ready, found.worst) {
        (false, _) => format!("vramguard at {url} is not ready"),
        (true, Status::Ok) => format!("vramguard at {url} is ready, admin reachable"),
        (true, _) => format!("vramguard at {url} is ready, with problems"),
    };
    let data = json!({
        "url": url,
        "running": true,
        "ready": is_ready,
        "admin": admin_result,
        "token_env": match token { Token::NotConfigured => None, Token::Unset(v) | Token::Set(v, _) => Some(v) },
        "status": status.as_ref().map(|d| json!({"version": d.version, "config": d.config,
                                                 "onnxruntime": d.onnxruntime, "degraded": d.degraded,
                                                 "policy": d.policy})),
    });
    let mut check = Check::new("server", found.worst, summary).data(data);
    check.details = found.lines;
    if !found.fixes.is_empty() {
        check.fix = Some(found.fixes.join("; "));
    }
    check
}

/// What `/status` says: the versions, degraded mode and the pools to restore, a refused
/// policy reload.
fn read_status(doc: &StatusReport, found: &mut Findings) {
    found.lines.push(format!(
        "vramguard {} serving {}, ONNX Runtime {}",
        doc.version, doc.config, doc.onnxruntime
    ));
    if doc.degraded.active {
        let reason = doc.degraded.reason.as_deref().unwrap_or("(no reason given)");
        found.note(Status::Warn, format!("DEGRADED: {reason}"));
        let down: Vec<String> = doc
            .pools
            .iter()
            .filter(|p| p.breaker != BreakerState::Closed || p.state != PoolAvailability::Ready)
            .map(|p| format!("`POST /admin/pools/{}/restore`", p.name))
            .collect();
        let restore = if down.is_empty() {
            "`POST /admin/pools/{pool}/restore`".to_string()
        } else {
            down.join(", ")
        };
        found
            .fixes
            .push(format!("once the cause is gone, {restore} brings it back"));
    }
    if let Some(error) = &doc.policy.last_error {
        found.note(Status::Warn, format!("the last policy reload was refused: {error}"));
        found
            .fixes
            .push("fix the policy file; the previous script keeps serving until then".to_string());
    }
}

/// How `GET /admin` went with this client; returns it in a word for the check's data.
fn read_admin(admin: &Result<Response, Failure>, token: &Token, found: &mut Findings) -> &'static str {
    match admin {
        Ok(r) if r.status == 200 => {
            let via = serde_json::from_str::<Value>(&r.body)
                .ok()
                .and_then(|v| v["auth"].as_str().map(str::to_string));
            let how = match (via.as_deref(), token) {
                (Some("socket"), _) => "through the admin socket".to_string(),
                (_, Token::Set(var, _)) => format!("with the bearer token from ${var}"),
                (via, _) => format!("as `{}`", via.unwrap_or("unknown")),
            };
            found.note(Status::Ok, format!("admin endpoints accept this client ({how})"));
            "authorized"
        }
        Ok(r) if r.status == 401 => {
            let (line, fix) = match token {
                Token::Set(var, _) => (
                    format!("admin refused the token in ${var}"),
                    format!("set ${var} to the token the server was started with"),
                ),
                Token::Unset(var) => (
                    format!("admin needs a bearer token, and ${var} is not set here"),
                    format!("export {var}=<the server's token> and run doctor again"),
                ),
                Token::NotConfigured => (
                    "admin needs a bearer token, and this config names no server.admin_token_env".to_string(),
                    "run doctor with the server's config (--config FILE) and its token variable set".to_string(),
                ),
            };
            found.note(Status::Fail, line);
            found.fixes.push(fix);
            "unauthorized"
        }
        Ok(r) if r.status == 403 => {
            found.note(
                Status::Warn,
                format!("admin refused this client: {}", error_of(&r.body)),
            );
            found
                .fixes
                .push("run doctor on the server's host, or set server.admin_token_env and its variable".to_string());
            "forbidden"
        }
        Ok(r) => {
            found.note(
                Status::Warn,
                format!(
                    "GET /admin answered {} ({}): admin access not checked (a server older than this doctor?)",
                    r.status,
                    error_of(&r.body)
                ),
            );
            "unknown"
        }
        Err(Failure::NotListening(e) | Failure::Other(e)) => {
            found.note(Status::Warn, format!("GET /admin failed: {e}"));
            "unknown"
        }
    }
}
