//! Serving one model across machines (issue 33), over MLX's own distributed layer through
//! mlx-c: the group of processes and its collectives. mlx-rs wraps none of it; these call
//! `mlx_distributed_*` directly, as `quant.rs` calls `mlx_quantize`.
//! Reference: MLX `mlx/distributed` (ring: TCP to each neighbour; JACCL: RDMA over Thunderbolt
//! 5), mlx-c `distributed.h` / `distributed_group.h`, mlx-lm `models/pipeline.py`.
//!
//! Joining cannot be cancelled: a ring rank blocks in `accept()` until its left neighbour
//! connects, forever if it never does. So [`Group::join`] runs under a watchdog that ends the
//! process, naming the ranks it waited for; a supervisor (or the user) starts it again. After
//! joining, every rank checks that all agree on rMLX's and MLX's versions and on the model
//! ([`fingerprint`]) before anything is served.

pub mod fingerprint;
pub mod health;
pub mod hostfile;
pub mod pipeline;
pub mod split;

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use mlx_rs::{Array, Dtype};

pub use hostfile::{Backend, Hostfile, HostfileError};

/// The exit status of a process whose group did not form in time.
pub const EXIT_JOIN_TIMEOUT: i32 = 3;

/// Seconds a rank waits for the others to join by default (`--join-timeout`).
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum DistributedError {
    #[error(transparent)]
    Hostfile(#[from] HostfileError),
    #[error("rank {rank} is not in the hostfile's {size} ranks (0..{})", size - 1)]
    Rank { rank: usize, size: usize },
    #[error("cannot write MLX's hostfile for rank {rank}: {message}")]
    Io { rank: usize, message: String },
    #[error("MLX could not start its {backend} backend on rank {rank} ({endpoint}): a peer refused or never answered, or this MLX build lacks the backend")]
    Init {
        backend: &'static str,
        rank: usize,
        endpoint: String,
    },
    #[error("the group MLX formed has {got} ranks, the hostfile {want}")]
    Size { got: usize, want: usize },
    #[error("distributed {op} failed on rank {rank}: {message}")]
    Collective {
        op: &'static str,
        rank: usize,
        message: String,
    },
    #[error("the ranks disagree on {what}: rank 0 has {first}, rank {rank} has {theirs}")]
    Disagree {
        what: String,
        rank: usize,
        first: String,
        theirs: String,
    },
}

/// Whether this MLX build has each backend rMLX can run a cluster on (`rmlx doctor`): the ring
/// everywhere, JACCL on macOS 26.2 and later with RDMA enabled.
pub fn backends_available() -> Vec<(&'static str, bool)> {
    [Backend::Ring, Backend::Jaccl]
        .into_iter()
        .map(|backend| {
            let name = std::ffi::CString::new(backend.mlx_name()).expect("no NUL in names");
            // SAFETY: a query taking a C string that outlives it.
            let available = unsafe { mlx_sys::mlx_distributed_is_available(name.as_ptr()) };
            (backend.mlx_name(), available)
        })
        .collect()
}

/// This process's place in a group of processes, one per rank of the hostfile.
pub struct Group {
    raw: mlx_sys::mlx_distributed_group,
    rank: usize,
    size: usize,
}

// SAFETY: MLX's group is a handle to its backend's sockets or devices; rMLX calls it from one
// thread at a time (the engine thread, or the CLI before the engine starts).
unsafe impl Send for Group {}
unsafe impl Sync for Group {}

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: the handle is ours and freed once.
        unsafe {
            mlx_sys::mlx_distributed_group_free(self.raw);
        }
    }
}

/// Collectives of the ring and JACCL backends run on the CPU (MLX has no GPU kernel for them).
struct CpuStream(mlx_sys::mlx_stream);

impl CpuStream {
    fn new() -> Self {
        // SAFETY: a new handle, freed on drop.
        Self(unsafe { mlx_sys::mlx_default_cpu_stream_new() })
    }
}

impl Drop for CpuStream {
    fn drop(&mut self) {
        // SAFETY: the handle is ours and freed once.
        unsafe {
            mlx_sys::mlx_stream_free(self.0);
        }
    }
}

impl Group {
    /// Joins the group `hostfile` describes as `rank`: MLX's inputs for the backend are set up
    /// (files under the temporary folder, the environment), then MLX's init runs. If the others
    /// have not joined within `timeout`, the process exits with [`EXIT_JOIN_TIMEOUT`], naming
    /// the ranks it waited for (a blocked accept cannot be cancelled). Call it before the
    /// engine starts: it sets environment variables MLX reads.
    pub fn join(
        hostfile: &Hostfile,
        rank: usize,
        timeout: Duration,
    ) -> Result<Self, DistributedError> {
        let size = hostfile.size();
        if rank >= size {
            return Err(DistributedError::Rank { rank, size });
        }
        let dir = std::env::temp_dir().join("rmlx-distributed");
        let environment =
            hostfile
                .mlx_environment(rank, &dir)
                .map_err(|error| DistributedError::Io {
                    rank,
                    message: error.to_string(),
                })?;
        for (key, value) in environment {
            std::env::set_var(key, value);
        }
        mlx_sys::load().map_err(|error| DistributedError::Io {
            rank,
            message: error.to_string(),
        })?;
        // mlx-rs's error handler, before the raw calls: mlx-c's own would exit the process.
        let _ = Array::from_int(0).eval();
        let joined = Arc::new(AtomicBool::new(false));
        watchdog(hostfile, rank, timeout, joined.clone());
        let backend = hostfile.backend.mlx_name();
        let name = std::ffi::CString::new(backend).expect("no NUL in backend names");
        // SAFETY: `raw` receives a new group handle (freed by Drop); strict: a failure is an
        // error, not a group of one.
        let (status, raw) = unsafe {
            let mut raw = mlx_sys::mlx_distributed_group_new();
            let status = mlx_sys::mlx_distributed_init(&mut raw, true, name.as_ptr());
            (status, raw)
        };
        joined.store(true, Ordering::SeqCst);
        if status != 0 || raw.ctx.is_null() {
            return Err(DistributedError::Init {
                backend,
                rank,
                endpoint: hostfile.endpoint(rank),
            });
        }
        // SAFETY: plain queries on a live group.
        let (got_rank, got_size) = unsafe {
            (
                mlx_sys::mlx_distributed_group_rank(raw) as usize,
                mlx_sys::mlx_distributed_group_size(raw) as usize,
            )
        };
        let group = Self {
            raw,
            rank: got_rank,
            size: got_size,
        };
        if got_size != size || got_rank != rank {
            return Err(DistributedError::Size {
                got: got_size,
                want: size,
            });
        }
        Ok(group)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Runs one mlx-c collective that fills an array; evaluated before it returns, so a lost
    /// peer is this call's error.
    fn collective(
        &self,
        op: &'static str,
        call: impl FnOnce(&mut mlx_sys::mlx_array, mlx_sys::mlx_stream) -> i32,
    ) -> Result<Array, DistributedError> {
        let stream = CpuStream::new();
        // SAFETY: `out` receives a new array handle, owned by the returned Array.
        let (status, out) = unsafe {
            let mut out = mlx_sys::mlx_array_new();
            let status = call(&mut out, stream.0);
            (status, Array::from_ptr(out))
        };
        let failed = |message: String| DistributedError::Collective {
            op,
            rank: self.rank,
            message,
        };
        if status != 0 {
            return Err(failed("MLX refused the operation".into()));
        }
        // mlx-rs appends where in its own source the exception surfaced: not the user's concern.
        out.eval().map_err(|error| {
            let message = error.to_string();
            failed(match message.find(" at /") {
                Some(at) => message[..at].trim_matches('"').to_string(),
                None => message,
            })
        })?;
        Ok(out)
    }

    /// The elementwise sum of `x` over every rank.
    pub fn all_sum(&self, x: &Array) -> Result<Array, DistributedError> {
        // SAFETY: live handles for the call.
        self.collective("all_sum", |out, stream| unsafe {
            mlx_sys::mlx_distributed_all_sum(out, x.as_ptr(), self.raw, stream)
        })
    }

    /// Every rank's `x`, concatenated along the first axis in rank order.
    pub fn all_gather(&self, x: &Array) -> Result<Array, DistributedError> {
        // SAFETY: live handles for the call.
        self.collective("all_gather", |out, stream| unsafe {
            mlx_sys::mlx_distributed_all_gather(out, x.as_ptr(), self.raw, stream)
        })
    }

    /// Sends `x` to rank `to` (the ring reaches only its neighbours, `rank ± 1`).
    pub fn send(&self, x: &Array, to: usize) -> Result<(), DistributedError> {
        // SAFETY: live handles for the call.
        self.collective("send", |out, stream| unsafe {
            mlx_sys::mlx_distributed_send(out, x.as_ptr(), to as i32, self.raw, stream)
        })
        .map(drop)
    }

    /// Receives from rank `from` an array of `shape` and `dtype`.
    pub fn recv(
        &self,
        shape: &[i32],
        dtype: Dtype,
        from: usize,
    ) -> Result<Array, DistributedError> {
        // SAFETY: live handles for the call; `shape` outlives it.
        self.collective("recv", |out, stream| unsafe {
            mlx_sys::mlx_distributed_recv(
                out,
                shape.as_ptr(),
                shape.len(),
                dtype as mlx_sys::mlx_dtype,
                from as i32,
                self.raw,
                stream,
            )
        })
    }

    /// Receives from rank `from` an array of `like`'s shape and dtype.
    pub fn recv_like(&self, like: &Array, from: usize) -> Result<Array, DistributedError> {
        // SAFETY: live handles for the call.
        self.collective("recv", |out, stream| unsafe {
            mlx_sys::mlx_distributed_recv_like(out, like.as_ptr(), from as i32, self.raw, stream)
        })
    }

    /// Checks that every rank holds the same `value` for `what` (a version, the model's
    /// fingerprint): its SHA-256 is gathered from all and compared with rank 0's.
    pub fn agree(&self, what: &str, value: &str) -> Result<(), DistributedError> {
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(value.as_bytes());
        let words: Vec<i32> = digest
            .chunks(4)
            .map(|chunk| i32::from_le_bytes(chunk.try_into().expect("32 bytes in fours")))
            .collect();
        let mine = Array::from_slice(&words, &[1, words.len() as i32]);
        let all: Vec<i32> = self.all_gather(&mine)?.as_slice::<i32>().to_vec();
        let short = |row: &[i32]| -> String {
            row.iter()
                .take(2)
                .map(|word| format!("{:08x}", *word as u32))
                .collect()
        };
        let first = &all[..words.len()];
        for (rank, row) in all.chunks(words.len()).enumerate().skip(1) {
            if row != first {
                return Err(DistributedError::Disagree {
                    what: what.to_string(),
                    rank,
                    first: short(first),
                    theirs: short(row),
                });
            }
        }
        Ok(())
    }
}

/// Ends the process if `joined` is not set within `timeout`, naming the neighbours a ring rank
/// waits for (it accepts from rank − 1 and connects to rank + 1).
fn watchdog(hostfile: &Hostfile, rank: usize, timeout: Duration, joined: Arc<AtomicBool>) {
    let size = hostfile.size();
    let neighbours: Vec<usize> = {
        let mut ranks = vec![(rank + size - 1) % size, (rank + 1) % size];
        ranks.dedup();
        ranks.retain(|&peer| peer != rank);
        ranks
    };
    let waited: Vec<String> = neighbours
        .iter()
        .map(|&peer| format!("rank {peer} at {}", hostfile.endpoint(peer)))
        .collect();
    let me = hostfile.endpoint(rank);
    let started = std::time::Instant::now();
    std::thread::spawn(move || {
        while started.elapsed() < timeout {
            if joined.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if !joined.load(Ordering::SeqCst) {
            eprintln!(
                "rmlx: rank {rank} ({me}) waited {:.0} s for {} to join and gave up: is `rmlx` \
                 running there with the same hostfile, and can this machine reach it? (a group \
                 cannot be joined later: exiting)",
                timeout.as_secs_f64(),
                waited.join(" and ")
            );
            std::process::exit(EXIT_JOIN_TIMEOUT);
        }
    });
}
