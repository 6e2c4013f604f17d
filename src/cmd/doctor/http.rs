//! The few HTTP GETs `doctor` makes to a running vramguard, on a blocking std socket: doctor
//! is a synchronous one-shot command, and vramguard serves plain HTTP, so an HTTP/1.0 request
//! read to the end of the connection needs no client library and no async runtime. (HTTP/1.0
//! also means the answer has no chunked encoding: the server closes after the body.)

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

/// How long a connection or a read may take before the server counts as hung.
const TIMEOUT: Duration = Duration::from_secs(3);

/// The most of a response that is read (`/status` of a large config is a few tens of KiB).
const MAX_RESPONSE: u64 = 4 << 20;

/// A server to ask: `http://host:port` without a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `host:port` as given (the `Host` header).
    pub authority: String,
}

impl Target {
    /// Parse `http://host[:port][/]`; the port defaults to 80.
    pub fn parse(url: &str) -> Result<Target, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| {
            format!("`{url}`: give an http:// URL (vramguard serves plain HTTP), e.g. http://127.0.0.1:8080")
        })?;
        let authority = rest.trim_end_matches('/');
        if authority.is_empty() || authority.contains('/') {
            return Err(format!(
                "`{url}`: give the server's address only, e.g. http://127.0.0.1:8080"
            ));
        }
        // `[::1]` has colons but no port: only digits after the last one are a port.
        let authority = if authority
            .rsplit_once(':')
            .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        {
            authority.to_string()
        } else {
            format!("{authority}:80")
        };
        Ok(Target { authority })
    }

    /// The URL of `path` on this server.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.authority)
    }
}

/// Why a request got no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Nothing listens there (connection refused): no server is running at that address.
    NotListening(String),
    /// Something else went wrong: no such host, a timeout, a connection closed before a status
    /// line.
    Other(String),
}

/// A response: status code and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// HTTP status code.
    pub status: u16,
    /// The body as text (lossily decoded).
    pub body: String,
}

/// `GET path` with an optional bearer token.
pub fn get(target: &Target, path: &str, bearer: Option<&str>) -> Result<Response, Failure> {
    let addrs: Vec<SocketAddr> = target
        .authority
        .to_socket_addrs()
        .map_err(|e| Failure::Other(format!("cannot resolve {}: {e}", target.authority)))?
        .collect();
    let mut last = Failure::Other(format!("{} resolves to no address", target.authority));
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, TIMEOUT) {
            Ok(stream) => return exchange(stream, target, path, bearer),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                last = Failure::NotListening(format!("{addr}: {e}"));
            }
            Err(e) => last = Failure::Other(format!("{addr}: {e}")),
        }
    }
    Err(last)
}

fn exchange(stream: TcpStream, target: &Target, path: &str, bearer: Option<&str>) -> Result<Response, Failure> {
    let io = |e: std::io::Error| Failure::Other(format!("{}: {e}", target.url(path)));
    stream.set_read_timeout(Some(TIMEOUT)).map_err(io)?;
    stream.set_write_timeout(Some(TIMEOUT)).map_err(io)?;
    request(stream, &target.authority, path, bearer, &target.url(path))
}

/// `GET path` on the admin Unix socket at `socket`.
pub fn get_unix(socket: &std::path::Path, path: &str) -> Result<Response, Failure> {
    let shown = format!("{}:{path}", socket.display());
    let stream = match std::os::unix::net::UnixStream::connect(socket) {
        Ok(stream) => stream,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
            ) =>
        {
            return Err(Failure::NotListening(format!("{}: {e}", socket.display())));
        }
        Err(e) => return Err(Failure::Other(format!("{}: {e}", socket.display()))),
    };
    let io = |e: std::io::Error| Failure::Other(format!("{shown}: {e}"));
    stream.set_read_timeout(Some(TIMEOUT)).map_err(io)?;
    stream.set_write_timeout(Some(TIMEOUT)).map_err(io)?;
    request(stream, "localhost", path, None, &shown)
}

/// Send one HTTP/1.0 GET on `stream` and read the whole answer; `shown` names it in errors.
fn request<S: Read + Write>(
    mut stream: S,
    host: &str,
    path: &str,
    bearer: Option<&str>,
    shown: &str,
) -> Result<Response, Failure> {
    let io = |e: std::io::Error| Failure::Other(format!("{shown}: {e}"));
    let auth = bearer.map_or(String::new(), |token| format!("Authorization: Bearer {token}\r\n"));
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {host}\r\nUser-Agent: vramguard-doctor\r\n{auth}\r\n"
    )
    .map_err(io)?;
    let mut raw = Vec::new();
    stream.take(MAX_RESPONSE).read_to_end(&mut raw).map_err(io)?;
    parse(&raw).ok_or_else(|| {
        Failure::Other(format!(
            "{shown}: the answer is not HTTP (is something else listening there?)"
        ))
    })
}

/// Split a whole HTTP/1.x response into status and body.
fn parse(raw: &[u8]) -> Option<Response> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status_line = head.lines().next()?;
    let mut parts = status_line.split_whitespace();
    if !parts.next()?.starts_with("HTTP/1.") {
        return None;
    }
    let status = parts.next()?.parse().ok()?;
    Some(Response {
        status,
        body: body.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_a_server_not_a_page() {
        assert_eq!(
            Target::parse("http://127.0.0.1:9000/").unwrap().url("/status"),
            "http://127.0.0.1:9000/status"
        );
        assert_eq!(Target::parse("http://localhost").unwrap().authority, "localhost:80");
        assert_eq!(Target::parse("http://[::1]:8080").unwrap().authority, "[::1]:8080");
        assert!(Target::parse("https://host:1").unwrap_err().contains("plain HTTP"));
        assert!(
            Target::parse("http://host:1/status")
                .unwrap_err()
                .contains("address only")
        );
    }

    #[test]
    fn responses_split_into_status_and_body() {
        let raw = b"HTTP/1.0 401 Unauthorized\r\ncontent-type: application/json\r\n\r\n{\"error\":\"x\"}";
        assert_eq!(
            parse(raw),
            Some(Response {
                status: 401,
                body: "{\"error\":\"x\"}".into()
            })
        );
        assert_eq!(parse(b"SSH-2.0-OpenSSH\r\n"), None);
    }

    #[test]
    fn a_closed_port_is_not_listening() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let target = Target::parse(&format!("http://127.0.0.1:{port}")).unwrap();
        assert!(matches!(get(&target, "/", None), Err(Failure::NotListening(_))));
    }
}
