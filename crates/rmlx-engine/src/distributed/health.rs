//! Whether every rank of the pipeline is alive (issue 33 d). A rank that dies makes the next
//! send or receive fail, but a stopped one (SIGSTOP, a hung machine) makes them block for
//! ever: MLX's ring cannot time out. So each rank also keeps a plain TCP heartbeat with rank 0
//! (rank 0 pings every follower twice a second at port + size + rank of the hostfile; silence
//! past the grace period, or a closed connection, is a lost peer). A lost peer is recorded
//! here: `/health` shows it, the server ends the requests in flight with a typed error (503
//! before a response started, an error event after), and after `EXIT_GRACE` the process exits
//! with [`EXIT_PEER_LOST`] for a supervisor to restart: never a hang.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::Mutex,
    time::{Duration, Instant},
};

use super::Hostfile;

/// The exit status of a process whose pipeline lost a peer.
pub const EXIT_PEER_LOST: i32 = 4;

/// How long `/health` and the requests in flight see the failure before the process exits.
pub const EXIT_GRACE: Duration = Duration::from_secs(2);

/// Silence past which a peer counts as lost.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);

const PING_EVERY: Duration = Duration::from_millis(500);

/// The heartbeat's block of ports in the hostfile (`Hostfile::rmlx_address`).
const HEARTBEAT: usize = 1;

/// One rank as `/health` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RankStatus {
    pub rank: usize,
    pub endpoint: String,
    /// The decoder layers it holds, `[start, end)`.
    pub layers: [usize; 2],
    /// Milliseconds since its last heartbeat (rank 0's own entry: 0).
    pub last_heartbeat_ms: Option<u64>,
}

struct State {
    ranks: Vec<(RankStatus, Option<Instant>)>,
    failure: Option<String>,
    /// This process is ending its pipeline's work on purpose: peers leaving are expected.
    stopping: bool,
}

static STATE: Mutex<State> = Mutex::new(State {
    ranks: Vec::new(),
    failure: None,
    stopping: false,
});

/// The pipeline's work ends on purpose (rank 0 stops, or a follower got rank 0's stop):
/// peers that leave from now on are not failures.
pub fn stopping() {
    STATE.lock().expect("not poisoned").stopping = true;
}

/// The ranks and their last heartbeats (empty in one process).
pub fn ranks() -> Vec<RankStatus> {
    let state = STATE.lock().expect("not poisoned");
    state
        .ranks
        .iter()
        .map(|(status, seen)| RankStatus {
            last_heartbeat_ms: seen.map(|at| at.elapsed().as_millis() as u64),
            ..status.clone()
        })
        .collect()
}

/// Why the pipeline failed, once it has.
pub fn failure() -> Option<String> {
    STATE.lock().expect("not poisoned").failure.clone()
}

/// Records that the pipeline lost a peer (the first reason wins) and ends the process after
/// [`EXIT_GRACE`].
pub fn fail(reason: String) {
    let mut state = STATE.lock().expect("not poisoned");
    if state.failure.is_some() || state.stopping {
        return;
    }
    eprintln!("rmlx: {reason}; exiting in {} s", EXIT_GRACE.as_secs());
    state.failure = Some(reason);
    std::thread::spawn(|| {
        std::thread::sleep(EXIT_GRACE);
        std::process::exit(EXIT_PEER_LOST);
    });
}

fn seen(rank: usize) {
    let mut state = STATE.lock().expect("not poisoned");
    if let Some((_, at)) = state.ranks.get_mut(rank) {
        *at = Some(Instant::now());
    }
}

/// Starts this rank's heartbeat threads: rank 0 pings each follower, a follower answers rank
/// 0. `layers` is every rank's plan; `grace` the silence that counts as a lost peer. Waits at
/// most `connect_within` for the followers' listeners (they start theirs first thing).
pub fn start(
    hostfile: &Hostfile,
    rank: usize,
    layers: &[std::ops::Range<usize>],
    grace: Duration,
    connect_within: Duration,
) -> std::io::Result<()> {
    {
        let mut state = STATE.lock().expect("not poisoned");
        state.ranks = (0..hostfile.size())
            .map(|r| {
                let status = RankStatus {
                    rank: r,
                    endpoint: hostfile.endpoint(r),
                    layers: [layers[r].start, layers[r].end],
                    last_heartbeat_ms: None,
                };
                // A rank does not beat for itself.
                (status, (r != rank).then(Instant::now))
            })
            .collect();
    }
    if rank == 0 {
        for follower in 1..hostfile.size() {
            let stream = connect(hostfile.rmlx_address(follower, HEARTBEAT), connect_within)?;
            let endpoint = hostfile.endpoint(follower);
            std::thread::spawn(move || ping(stream, follower, endpoint, grace));
        }
        return Ok(());
    }
    let listener = TcpListener::bind(hostfile.rmlx_address(rank, HEARTBEAT))?;
    let leader = hostfile.endpoint(0);
    std::thread::spawn(move || answer(listener, leader, grace));
    Ok(())
}

fn connect(at: SocketAddr, within: Duration) -> std::io::Result<TcpStream> {
    let started = Instant::now();
    loop {
        match TcpStream::connect_timeout(&at, Duration::from_secs(1)) {
            Ok(stream) => return Ok(stream),
            Err(error) if started.elapsed() > within => {
                return Err(std::io::Error::new(
                    error.kind(),
                    format!("no heartbeat listener at {at}: {error}"),
                ))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// Rank 0's side: a byte out, a byte back, twice a second.
fn ping(mut stream: TcpStream, rank: usize, at: String, grace: Duration) {
    let _ = stream.set_read_timeout(Some(grace));
    let _ = stream.set_nodelay(true);
    let mut byte = [0u8; 1];
    loop {
        let answered = stream
            .write_all(&[1])
            .and_then(|_| stream.read_exact(&mut byte));
        if let Err(error) = answered {
            fail(lost(rank, &at, grace, &error));
            return;
        }
        seen(rank);
        std::thread::sleep(PING_EVERY);
    }
}

/// A follower's side: answers rank 0's pings; silence past `grace` means rank 0 is gone.
fn answer(listener: TcpListener, leader: String, grace: Duration) {
    let stream = listener.accept();
    let Ok((mut stream, _)) = stream else {
        fail(format!("rank 0 ({leader}) never opened the heartbeat"));
        return;
    };
    let _ = stream.set_read_timeout(Some(grace));
    let _ = stream.set_nodelay(true);
    let mut byte = [0u8; 1];
    loop {
        let answered = stream
            .read_exact(&mut byte)
            .and_then(|_| stream.write_all(&byte));
        if let Err(error) = answered {
            fail(lost(0, &leader, grace, &error));
            return;
        }
        seen(0);
    }
}

fn lost(rank: usize, at: &str, grace: Duration, error: &std::io::Error) -> String {
    match error.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
            "rank {rank} ({at}) has not answered for {:.0} s (stopped or hung)",
            grace.as_secs_f64()
        ),
        _ => format!("rank {rank} ({at}) is gone ({error})"),
    }
}
