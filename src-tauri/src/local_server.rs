//! The tray's "Local API server": the same router the app uses over IPC, bound to
//! 127.0.0.1:PORT while switched on. A busy port is a clear error the tray shows, never a
//! crash; switching off lets in-flight requests finish.

use std::{net::SocketAddr, sync::Mutex};

use rmlx_server::AppState;
use serde::Serialize;
use tokio::sync::oneshot;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ServerStatus {
    Off,
    On {
        url: String,
    },
    /// Switched on but could not listen (the port is taken, say).
    Failed {
        message: String,
        port: u16,
    },
}

impl ServerStatus {
    /// One line for the tray's status item.
    pub fn summary(&self) -> String {
        match self {
            ServerStatus::Off => "Server: off".into(),
            ServerStatus::On { url } => format!("Server: on · {url}"),
            ServerStatus::Failed { message, .. } => format!("Server: {message}"),
        }
    }
}

struct Running {
    address: SocketAddr,
    stop: oneshot::Sender<()>,
    served: tokio::task::JoinHandle<()>,
}

pub struct LocalServer {
    /// What the next start serves, and where: settings changes replace it.
    target: Mutex<(AppState, String)>,
    running: Mutex<Option<Running>>,
    status: Mutex<ServerStatus>,
}

impl LocalServer {
    pub fn new(state: AppState, host: &str) -> Self {
        Self {
            target: Mutex::new((state, host.to_string())),
            running: Mutex::default(),
            status: Mutex::new(ServerStatus::Off),
        }
    }

    /// The port it listens on now, if it does.
    pub fn port(&self) -> Option<u16> {
        self.running
            .lock()
            .unwrap()
            .as_ref()
            .map(|r| r.address.port())
    }

    /// Serves `state` on `host` from now on: a running server restarts on its port with them
    /// (settings changed the API key, CORS origins, models folder or address).
    pub async fn reconfigure(&self, state: AppState, host: &str) -> ServerStatus {
        *self.target.lock().unwrap() = (state, host.to_string());
        match self.port() {
            Some(port) => {
                self.stop().await;
                self.start(port).await
            }
            None => self.status(),
        }
    }

    pub fn status(&self) -> ServerStatus {
        self.status.lock().unwrap().clone()
    }

    /// Listens on `port` (0 picks a free one); a running server on another port is stopped
    /// first. Returns the new status (also on failure, which is a status, not an error).
    pub async fn start(&self, port: u16) -> ServerStatus {
        let current = self.running.lock().unwrap().as_ref().map(|r| r.address);
        if let Some(address) = current {
            if address.port() == port || port == 0 {
                return self.status();
            }
            self.stop().await;
        }
        let (state, host) = self.target.lock().unwrap().clone();
        let status = match tokio::net::TcpListener::bind((host.as_str(), port)).await {
            Ok(listener) => {
                let address = listener
                    .local_addr()
                    .expect("a bound listener has an address");
                let (stop, stopped) = oneshot::channel::<()>();
                let served = tokio::spawn(async move {
                    let shutdown = async {
                        let _ = stopped.await;
                    };
                    if let Err(error) = rmlx_server::serve_on(listener, state, shutdown).await {
                        eprintln!("rmlx-app: the local server failed: {error:#}");
                    }
                });
                *self.running.lock().unwrap() = Some(Running {
                    address,
                    stop,
                    served,
                });
                ServerStatus::On {
                    url: format!("http://{address}"),
                }
            }
            Err(error) if error.kind() == std::io::ErrorKind::AddrInUse => ServerStatus::Failed {
                message: format!("port {port} is in use; choose another port"),
                port,
            },
            Err(error) => ServerStatus::Failed {
                message: format!("cannot listen on {host}:{port}: {error}"),
                port,
            },
        };
        *self.status.lock().unwrap() = status.clone();
        status
    }

    /// Stops listening and returns once the port is closed (in-flight requests get a few
    /// seconds to finish); a stopped server stays stopped.
    pub async fn stop(&self) -> ServerStatus {
        let running = self.running.lock().unwrap().take();
        if let Some(running) = running {
            let _ = running.stop.send(());
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), running.served).await;
        }
        *self.status.lock().unwrap() = ServerStatus::Off;
        ServerStatus::Off
    }
}
