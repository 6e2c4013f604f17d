//! The few GETs `doctor` makes to a running vramguard, with reqwest's blocking client: doctor is
//! a synchronous one-shot command, so it needs no async runtime of its own.

use std::io::Read;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use crate::core::human::error_chain;

/// How long one request may take, connecting and reading the whole answer, before the server
/// counts as hung.
const TIMEOUT: Duration = Duration::from_secs(3);

/// The most of a response that is read (`/status` of a large config is a few tens of KiB).
const MAX_RESPONSE: u64 = 4 << 20;

/// Why a request got no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Nothing listens there (connection refused, or no socket file): no server is running at
    /// that address.
    NotListening(String),
    /// Something else went wrong: no such host, a timeout, an answer that is not HTTP.
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

/// The base URL of a server to ask, `http://host:port`, from what a user gave: an http:// URL
/// of the server's address only; the port defaults to 80.
pub fn base_url(url: &str) -> Result<String, String> {
    let only_address = || format!("`{url}`: give the server's address only, e.g. http://127.0.0.1:8080");
    let parsed = reqwest::Url::parse(url)
        .map_err(|e| format!("`{url}`: {e}; give an http:// URL, e.g. http://127.0.0.1:8080"))?;
    if parsed.scheme() != "http" {
        return Err(format!(
            "`{url}`: give an http:// URL (vramguard serves plain HTTP), e.g. http://127.0.0.1:8080"
        ));
    }
    let extra = parsed.path() != "/"
        || parsed.query().is_some()
        || parsed.fragment().is_some()
        || !parsed.username().is_empty()
        || parsed.password().is_some();
    let host = parsed.host_str().filter(|_| !extra).ok_or_else(only_address)?;
    Ok(format!(
        "http://{host}:{}",
        parsed.port_or_known_default().unwrap_or(80)
    ))
}

/// `GET path` on the server at `base` (from [`base_url`]), with an optional bearer token.
pub fn get(base: &str, path: &str, bearer: Option<&str>) -> Result<Response, Failure> {
    // One client for every request of a run: each blocking client starts a runtime thread.
    static TCP: OnceLock<Result<reqwest::blocking::Client, String>> = OnceLock::new();
    let url = format!("{base}{path}");
    let client = TCP
        .get_or_init(|| builder().build().map_err(|e| error_chain(&e)))
        .as_ref()
        .map_err(|e| Failure::Other(format!("{url}: {e}")))?;
    let mut request = client.get(&url);
    if let Some(token) = bearer {
        request = request.bearer_auth(token);
    }
    exchange(request, &url)
}

/// `GET path` on the admin Unix socket at `socket`.
pub fn get_unix(socket: &Path, path: &str) -> Result<Response, Failure> {
    let shown = format!("{}:{path}", socket.display());
    let client = builder()
        .unix_socket(socket)
        .build()
        .map_err(|e| Failure::Other(format!("{shown}: {}", error_chain(&e))))?;
    exchange(client.get(format!("http://localhost{path}")), &shown)
}

fn builder() -> reqwest::blocking::ClientBuilder {
    reqwest::blocking::Client::builder()
        .connect_timeout(TIMEOUT)
        .timeout(TIMEOUT)
        .user_agent("vramguard-doctor")
        // Doctor asks the address it was given, never a proxy named in the environment.
        .no_proxy()
}

/// Send `request` and read its whole answer; `shown` names it in errors.
fn exchange(request: reqwest::blocking::RequestBuilder, shown: &str) -> Result<Response, Failure> {
    let response = request.send().map_err(|e| failure(shown, &e))?;
    let status = response.status().as_u16();
    let mut raw = Vec::new();
    response
        .take(MAX_RESPONSE)
        .read_to_end(&mut raw)
        .map_err(|e| Failure::Other(format!("{shown}: {e}")))?;
    Ok(Response {
        status,
        body: String::from_utf8_lossy(&raw).into_owned(),
    })
}

/// A refused connection (or a socket file that is not there) means nothing runs at that
/// address; anything else is a server that is there and not answering as it should.
fn failure(shown: &str, error: &reqwest::Error) -> Failure {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        let refused = e.downcast_ref::<std::io::Error>().filter(|io| {
            matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
            )
        });
        if let Some(io) = refused {
            return Failure::NotListening(format!("{shown}: {io}"));
        }
        source = e.source();
    }
    if error.is_timeout() {
        return Failure::Other(format!("{shown}: no answer within {} s", TIMEOUT.as_secs()));
    }
    Failure::Other(format!("{shown}: {}", error_chain(error)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_a_server_not_a_page() {
        assert_eq!(
            format!("{}/status", base_url("http://127.0.0.1:9000/").unwrap()),
            "http://127.0.0.1:9000/status"
        );
        assert_eq!(base_url("http://localhost").unwrap(), "http://localhost:80");
        assert_eq!(base_url("http://[::1]:8080").unwrap(), "http://[::1]:8080");
        assert!(base_url("https://host:1").unwrap_err().contains("plain HTTP"));
        assert!(base_url("http://host:1/status").unwrap_err().contains("address only"));
    }

    #[test]
    fn a_closed_port_is_not_listening() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let base = base_url(&format!("http://127.0.0.1:{port}")).unwrap();
        assert!(matches!(get(&base, "/", None), Err(Failure::NotListening(_))));
        let socket = std::env::temp_dir().join(format!("vramguard-doctor-{}-none.sock", std::process::id()));
        assert!(matches!(get_unix(&socket, "/admin"), Err(Failure::NotListening(_))));
    }

    /// What `get` makes of `answer`, sent by a server that reads the request, answers and
    /// closes.
    fn answered(answer: &'static [u8]) -> Result<Response, Failure> {
        use std::io::{BufRead, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = std::io::BufReader::new(stream);
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                line.clear();
            }
            let _ = reader.get_mut().write_all(answer);
        });
        let base = base_url(&format!("http://127.0.0.1:{port}")).unwrap();
        let got = get(&base, "/", None);
        server.join().unwrap();
        got
    }

    #[test]
    fn responses_split_into_status_and_body() {
        let raw = b"HTTP/1.0 401 Unauthorized\r\ncontent-type: application/json\r\n\r\n{\"error\":\"x\"}";
        assert_eq!(
            answered(raw),
            Ok(Response {
                status: 401,
                body: "{\"error\":\"x\"}".into()
            })
        );
        assert!(matches!(answered(b"SSH-2.0-OpenSSH\r\n"), Err(Failure::Other(_))));
    }
}
