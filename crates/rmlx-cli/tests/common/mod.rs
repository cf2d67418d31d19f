//! What the tests share: the repository root, the SDK venv's Python (SDK and contract
//! suites), one HTTP exchange with a server started as a subprocess.

// Each test file uses its own part of this module.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `.venv-sdk`'s Python (scripts/sdk-venv makes it), or `None` after saying how to get it; with
/// `RMLX_REQUIRE_SDK=1` a missing venv fails instead, so `make test` never skips these.
pub fn sdk_python(what: &str) -> Option<PathBuf> {
    let python = root().join(".venv-sdk/bin/python");
    if python.exists() {
        return Some(python);
    }
    assert!(
        std::env::var("RMLX_REQUIRE_SDK").as_deref() != Ok("1"),
        "RMLX_REQUIRE_SDK=1 but .venv-sdk is missing: run scripts/sdk-venv"
    );
    eprintln!("skipped: no .venv-sdk (run scripts/sdk-venv to enable the {what})");
    None
}

/// One HTTP/1.1 exchange with `rmlx serve` on loopback (the tests need no client crate): the
/// status and the JSON body (null when the body is not JSON). The request is written from
/// another thread while this one reads, so a server that answers before reading the whole body
/// (413, a 503 for memory) is heard rather than failing the write.
pub fn http(port: u16, method: &str, path: &str, body: Option<&str>) -> (u16, serde_json::Value) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let body = body.unwrap_or("");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut writer = stream.try_clone().unwrap();
    let writing = std::thread::spawn(move || {
        // A server that answered early may close before the body is through.
        let _ = writer.write_all(request.as_bytes());
    });
    let mut reply = Vec::new();
    let _ = stream.read_to_end(&mut reply);
    writing.join().unwrap();
    let reply = String::from_utf8_lossy(&reply);
    let (head, payload) = reply
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no reply (did the server die?): {reply:?}"));
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(payload).unwrap_or_default())
}

/// The port a just-started `rmlx serve --port 0` listens on, read from its first stdout line
/// ("rmlx serve: listening on http://127.0.0.1:PORT").
pub fn listening_port(server: &mut std::process::Child) -> u16 {
    use std::io::BufRead;
    let mut line = String::new();
    std::io::BufReader::new(server.stdout.take().expect("stdout piped"))
        .read_line(&mut line)
        .unwrap();
    line.trim()
        .rsplit(':')
        .next()
        .and_then(|port| port.parse().ok())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
}
