//! One model split into stages across the ranks (issue 33 b): rank 0 embeds, runs its layers
//! and sends the hidden state on; each rank runs its own layers and passes it to the next; the
//! last sends it back to rank 0, which applies the final norm and the output layer. What a
//! family's later layers need besides the hidden state (rotary rows, Gemma 4's per-layer
//! inputs, image spans) rides along in the same message.
//! Reference: mlx-lm `models/pipeline.py` and `models/deepseek_v3.py` (`pipeline` and the
//! send / recv around the layer loop); here embeddings and sampling stay on rank 0 only.

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    ops::Range,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use mlx_rs::{Array, Dtype};

use super::{DistributedError, Group, Hostfile};
use crate::error::{EngineError, Result};

/// Arrays one message may carry: the cache log and ids, the hidden state and its riders.
const MAX_ARRAYS: usize = 5;
/// Dimensions per array in a message's header.
const MAX_DIMS: usize = 4;
/// Words before the arrays' entries: kind, array count, the logits wanted, the chunk's
/// position.
const PREAMBLE: usize = 4;
/// An array's entry: dtype, rank, dimensions, and where in the header its words are (-1: sent
/// on its own after the header).
const ENTRY: usize = 3 + MAX_DIMS;
/// Words at the header's end for small int32 arrays (the cache log and ids, rotary rows of a
/// decode step): carried in the header, each saves a send and a receive.
const INLINE: usize = 512;
/// A message's header: the preamble, the arrays' entries, the inline words.
const HEADER: usize = PREAMBLE + MAX_ARRAYS * ENTRY + INLINE;
const INLINE_AT: usize = PREAMBLE + MAX_ARRAYS * ENTRY;
/// The header's first word: a forward's input (rank to next rank), the last rank's output
/// (back to rank 0), or the end of the pipeline's work.
const FORWARD: i32 = 0x524d_4c58; // "RMLX"
const BACK: i32 = 0x4241_434b; // "BACK"
const STOP: i32 = 0x5354_4f50; // "STOP"

/// What a forward's message tells a follower besides the arrays its layers read.
pub struct Forward {
    /// Rank 0's cache operations since the last forward (`cache_mirror`).
    pub log: Vec<i32>,
    /// The ids of the caches this forward runs on, one per layer.
    pub ids: Vec<i32>,
    /// What rank 0 wants back: every position, the last, or nothing (`Logits`).
    pub logits: crate::models::Logits,
    /// Where the chunk starts (rank 0's first cache's offset), checked against the copies.
    pub position: i32,
}

/// Plain TCP doorbells beside MLX's ring, one from each rank to the next (the last to rank 0):
/// a rank rings before each message, and a rank waiting for one blocks on its bell (the kernel
/// wakes it) instead of inside MLX's receive, which polls its socket and would keep a core busy
/// for as long as a follower idles. Rank r listens at port + 2 × size + r of the hostfile.
pub struct Bells {
    next: Mutex<TcpStream>,
    previous: Mutex<TcpStream>,
    /// The ranks at either end: (previous, next).
    peers: (usize, usize),
}

impl Bells {
    pub fn connect(hostfile: &Hostfile, rank: usize, within: Duration) -> std::io::Result<Self> {
        let size = hostfile.size();
        // The doorbells' block of ports (the heartbeat's is 1).
        let address = |r: usize| hostfile.rmlx_address(r, 2);
        let listener = TcpListener::bind(address(rank))?;
        let started = Instant::now();
        let next = loop {
            match TcpStream::connect_timeout(&address((rank + 1) % size), Duration::from_secs(1)) {
                Ok(stream) => break stream,
                Err(error) if started.elapsed() > within => return Err(error),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        listener.set_nonblocking(true)?;
        let previous = loop {
            match listener.accept() {
                Ok((stream, _)) => break stream,
                Err(error) if error.kind() != std::io::ErrorKind::WouldBlock => return Err(error),
                Err(error) if started.elapsed() > within => return Err(error),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        previous.set_nonblocking(false)?;
        for stream in [&next, &previous] {
            stream.set_nodelay(true)?;
        }
        Ok(Self {
            next: Mutex::new(next),
            previous: Mutex::new(previous),
            peers: ((rank + size - 1) % size, (rank + 1) % size),
        })
    }

    fn ring(&self) -> Result<()> {
        let mut next = self.next.lock().expect("not poisoned");
        next.write_all(&[1])
            .map_err(|error| bell_lost(self.peers.1, &error))
    }

    fn wait(&self) -> Result<()> {
        let mut byte = [0u8; 1];
        let mut previous = self.previous.lock().expect("not poisoned");
        previous
            .read_exact(&mut byte)
            .map_err(|error| bell_lost(self.peers.0, &error))
    }
}

fn bell_lost(rank: usize, error: &std::io::Error) -> EngineError {
    let message = match error.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => format!("rank {rank} is gone (its connection closed)"),
        _ => format!("lost rank {rank}: {error}"),
    };
    super::health::fail(message.clone());
    EngineError::Distributed(message)
}

/// This process's stage: which layers it computes, and its group.
pub struct Stage {
    group: Arc<Group>,
    /// Set where the ranks joined with doorbells (every real pipeline; see [`Bells`]).
    bells: Option<Bells>,
    /// Each rank's layers, in rank order (contiguous, covering the model).
    layers: Vec<Range<usize>>,
    /// A follower's input arrays, received by its loop ([`Self::next`]) before the forward.
    pending: Mutex<Option<Vec<Array>>>,
    /// The running forward's log, ids and what rank 0 wants back (a follower passes them on).
    current: Mutex<(Array, Array, crate::models::Logits)>,
}

impl Stage {
    /// Rank 0 of a pipeline of more than one rank also starts logging its caches' operations
    /// (`cache_mirror`): make the stage before any cache.
    pub fn new(group: Arc<Group>, layers: Vec<Range<usize>>) -> Self {
        debug_assert_eq!(group.size(), layers.len());
        if group.rank() == 0 && group.size() > 1 {
            crate::cache_mirror::enable();
        }
        let empty = || Array::from_slice::<i32>(&[], &[0]);
        Self {
            group,
            bells: None,
            layers,
            pending: Mutex::new(None),
            current: Mutex::new((empty(), empty(), crate::models::Logits::Last)),
        }
    }

    /// The stage with doorbells to wait on instead of MLX's polling receive.
    pub fn with_bells(mut self, bells: Bells) -> Self {
        self.bells = Some(bells);
        self
    }

    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// Rank 0 holds everything outside the layers: embeddings, vision tower, norm, output.
    pub fn is_first(&self) -> bool {
        self.rank() == 0
    }

    /// The layers this rank computes.
    pub fn own_layers(&self) -> Range<usize> {
        self.layers[self.rank()].clone()
    }

    pub fn owns(&self, layer: usize) -> bool {
        self.own_layers().contains(&layer)
    }

    /// A follower's next forward from the previous rank (its arrays kept for the forward it
    /// starts); None once rank 0 ended the pipeline's work (passed on to the next rank first).
    pub fn next(&self) -> Result<Option<Forward>> {
        let from = self.rank() - 1;
        let Some((kind, header, mut arrays)) = self.receive_from(from)? else {
            super::health::stopping();
            if self.rank() + 1 < self.size() {
                self.send_stop(self.rank() + 1)?;
            }
            return Ok(None);
        };
        if kind != FORWARD || arrays.len() < 3 {
            return Err(protocol(format!("rank {from} sent no forward")));
        }
        let rest = arrays.split_off(2);
        let ids = arrays.pop().expect("two");
        let log = arrays.pop().expect("one");
        let words = |array: &Array| -> Result<Vec<i32>> {
            match array.size() {
                0 => Ok(Vec::new()),
                _ => Ok(array.as_dtype(Dtype::Int32)?.as_slice::<i32>().to_vec()),
            }
        };
        let forward = Forward {
            log: words(&log)?,
            ids: words(&ids)?,
            logits: logits_of(header[2]),
            position: header[3],
        };
        *self.current.lock().expect("not poisoned") = (log, ids, forward.logits);
        *self.pending.lock().expect("not poisoned") = Some(rest);
        Ok(Some(forward))
    }

    /// A follower's input in its forward: the hidden state and what rides with it.
    pub fn receive(&self) -> Result<Vec<Array>> {
        self.pending
            .lock()
            .expect("not poisoned")
            .take()
            .ok_or_else(|| protocol("a forward ran with no message from the previous rank".into()))
    }

    /// Rank 0, when its work is done: the followers leave their loops (and exit).
    pub fn stop_followers(&self) -> Result<()> {
        super::health::stopping();
        match self.size() > 1 && self.is_first() {
            true => self.send_stop(1),
            false => Ok(()),
        }
    }

    /// After this rank's layers: on to the next rank, or (the last) back to rank 0 with the
    /// positions rank 0 asked for (`logits` there; nothing for [`Logits::None`]). Rank 0 then
    /// receives the final hidden state and gets it back; the others get None (they have no
    /// output layer), and so does rank 0 when it asked for nothing.
    /// `position`: rank 0's cache offset before this chunk; `ids`: its caches' log ids.
    ///
    /// [`Logits::None`]: crate::models::Logits::None
    pub fn pass_on(
        &self,
        h: &Array,
        riders: &[Array],
        logits: crate::models::Logits,
        position: i32,
        ids: &[i32],
    ) -> Result<Option<Array>> {
        use crate::models::Logits;
        let size = self.size();
        if size == 1 {
            return Ok(Some(h.clone()));
        }
        let rank = self.rank();
        let (log, ids, logits) = match rank {
            0 => {
                let log = crate::cache_mirror::take_log();
                (
                    Array::from_slice(&log, &[log.len() as i32]),
                    Array::from_slice(ids, &[ids.len() as i32]),
                    logits,
                )
            }
            _ => self.current.lock().expect("not poisoned").clone(),
        };
        if rank + 1 < size {
            let mut arrays = vec![log, ids, h.clone()];
            arrays.extend(riders.iter().cloned());
            self.send_to(FORWARD, &arrays, rank + 1, logits, position)?;
        } else if logits != Logits::None {
            let len = h.shape()[1];
            let h = match logits == Logits::Last && len > 1 {
                true => mlx_rs::ops::indexing::IndexOp::index(h, (.., (len - 1)..)),
                false => h.clone(),
            };
            self.send_to(BACK, &[h], 0, logits, position)?;
        }
        if rank != 0 || logits == Logits::None {
            return Ok(None);
        }
        match self.receive_from(size - 1)? {
            Some((BACK, _, mut arrays)) if arrays.len() == 1 => Ok(arrays.pop()),
            _ => Err(protocol(
                "the last rank did not send the hidden state back".into(),
            )),
        }
    }

    /// Messages go only to the next rank (the last rank's to rank 0), so one bell serves all.
    fn ring(&self, to: usize) -> Result<()> {
        debug_assert_eq!(to, (self.rank() + 1) % self.size());
        match &self.bells {
            Some(bells) => bells.ring(),
            None => Ok(()),
        }
    }

    fn send_stop(&self, to: usize) -> Result<()> {
        self.ring(to)?;
        let mut header = vec![0i32; HEADER];
        header[0] = STOP;
        self.group
            .send(&Array::from_slice(&header, &[HEADER as i32]), to)
            .map_err(lost(to))
    }

    fn send_to(
        &self,
        kind: i32,
        arrays: &[Array],
        to: usize,
        logits: crate::models::Logits,
        position: i32,
    ) -> Result<()> {
        if arrays.len() > MAX_ARRAYS {
            return Err(protocol(format!("{} arrays in one message", arrays.len())));
        }
        let mut header = vec![0i32; HEADER];
        header[0] = kind;
        header[1] = arrays.len() as i32;
        header[2] = logits_code(logits);
        header[3] = position;
        let mut inlined = 0;
        let mut separate = Vec::new();
        for (index, array) in arrays.iter().enumerate() {
            let shape = array.shape();
            if shape.len() > MAX_DIMS {
                return Err(protocol(format!("an array of {} dimensions", shape.len())));
            }
            let at = PREAMBLE + index * ENTRY;
            header[at] = u32::from(array.dtype()) as i32;
            header[at + 1] = shape.len() as i32;
            header[at + 2..at + 2 + shape.len()].copy_from_slice(shape);
            header[at + 2 + MAX_DIMS] = -1;
            let size = array.size();
            if size > 0 && array.dtype() == Dtype::Int32 && inlined + size <= INLINE {
                let start = INLINE_AT + inlined;
                header[start..start + size].copy_from_slice(array.as_slice::<i32>());
                header[at + 2 + MAX_DIMS] = inlined as i32;
                inlined += size;
            } else if size > 0 {
                separate.push(array);
            }
        }
        self.ring(to)?;
        let group = &self.group;
        group
            .send(&Array::from_slice(&header, &[HEADER as i32]), to)
            .map_err(lost(to))?;
        for array in separate {
            group.send(array, to).map_err(lost(to))?;
        }
        Ok(())
    }

    /// The next message from rank `from`: its kind, header and arrays; None when it is the
    /// pipeline's stop.
    #[allow(clippy::type_complexity)]
    fn receive_from(&self, from: usize) -> Result<Option<(i32, Vec<i32>, Vec<Array>)>> {
        if let Some(bells) = &self.bells {
            bells.wait()?;
        }
        let header = self
            .group
            .recv(&[HEADER as i32], Dtype::Int32, from)
            .map_err(lost(from))?;
        let header = header.as_slice::<i32>().to_vec();
        let kind = header[0];
        if kind == STOP {
            return Ok(None);
        }
        let count = header[1];
        if !(kind == FORWARD || kind == BACK) || !(0..=MAX_ARRAYS as i32).contains(&count) {
            return Err(protocol(format!(
                "rank {from} sent a header this rank cannot read ({kind:x}, {count})"
            )));
        }
        let arrays = (0..count as usize)
            .map(|index| {
                let at = PREAMBLE + index * ENTRY;
                let dtype = Dtype::try_from(header[at] as u32)
                    .map_err(|_| protocol(format!("unknown dtype {}", header[at])))?;
                let ndim = (header[at + 1].clamp(0, MAX_DIMS as i32)) as usize;
                let shape = &header[at + 2..at + 2 + ndim];
                if shape.contains(&0) {
                    return Ok(mlx_rs::ops::zeros_dtype(shape, dtype)?);
                }
                let size: usize = shape.iter().map(|&dim| dim.max(0) as usize).product();
                match usize::try_from(header[at + 2 + MAX_DIMS]) {
                    Ok(start) if start + size <= INLINE => {
                        let words = &header[INLINE_AT + start..INLINE_AT + start + size];
                        Ok(Array::from_slice(words, shape))
                    }
                    Ok(_) => Err(protocol(format!("rank {from} inlined past the header"))),
                    Err(_) => self.group.recv(shape, dtype, from).map_err(lost(from)),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some((kind, header, arrays)))
    }
}

/// How a message's header says what rank 0 wants back.
fn logits_code(logits: crate::models::Logits) -> i32 {
    use crate::models::Logits;
    match logits {
        Logits::All => 0,
        Logits::Last => 1,
        Logits::None => 2,
    }
}

fn logits_of(code: i32) -> crate::models::Logits {
    use crate::models::Logits;
    match code {
        0 => Logits::All,
        2 => Logits::None,
        _ => Logits::Last,
    }
}

/// A failed send to or receive from rank `peer`: it is gone, and the pipeline with it.
fn lost(peer: usize) -> impl Fn(DistributedError) -> EngineError {
    move |error| {
        let message = format!("rank {peer} was lost ({error})");
        super::health::fail(message.clone());
        EngineError::Distributed(message)
    }
}

fn protocol(message: String) -> EngineError {
    EngineError::Distributed(format!("pipeline message: {message}"))
}

/// Which parts of a model this process loads and runs: all of it, or one stage's layers (and,
/// on rank 0, everything outside the layers).
#[derive(Clone, Default)]
pub struct Part {
    pub stage: Option<Arc<Stage>>,
}

impl std::fmt::Debug for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.stage() {
            None => write!(f, "Part(whole)"),
            Some(stage) => write!(
                f,
                "Part(rank {} of {}, layers {:?})",
                stage.rank(),
                stage.size(),
                stage.own_layers()
            ),
        }
    }
}

impl Part {
    pub fn has_layer(&self, layer: usize) -> bool {
        self.stage.as_ref().is_none_or(|stage| stage.owns(layer))
    }

    /// Embeddings, the vision tower, the final norm and output layer, a draft head.
    pub fn has_ends(&self) -> bool {
        self.stage.as_ref().is_none_or(|stage| stage.is_first())
    }

    /// `load()` where this process holds the ends (one process, or rank 0); None elsewhere.
    pub fn ends<T>(&self, load: impl FnOnce() -> Result<T>) -> Result<Option<T>> {
        self.has_ends().then(load).transpose()
    }

    /// Where this process does not hold the ends: their tensors under `prefixes`, dropped
    /// unread (strict loading then finds nothing of theirs left over).
    pub fn drop_ends(&self, store: &mut crate::weights::WeightStore, prefixes: &[&str]) {
        if !self.has_ends() {
            prefixes
                .iter()
                .for_each(|prefix| store.discard_prefix(prefix));
        }
    }

    /// Layer `index`, whose tensors are under `prefix.`: `load(store)` where this process
    /// computes it; elsewhere None, its tensors dropped unread.
    pub fn layer<T>(
        &self,
        index: usize,
        store: &mut crate::weights::WeightStore,
        prefix: &str,
        load: impl FnOnce(&mut crate::weights::WeightStore) -> Result<T>,
    ) -> Result<Option<T>> {
        if !self.has_layer(index) {
            store.discard_prefix(&format!("{prefix}."));
            return Ok(None);
        }
        load(store).map(Some)
    }

    /// A follower's stage (it receives its input instead of embedding tokens).
    pub fn follower(&self) -> Option<&Stage> {
        self.stage.as_deref().filter(|stage| !stage.is_first())
    }

    pub fn stage(&self) -> Option<&Stage> {
        self.stage.as_deref()
    }
}

/// What a family's forward returns on a rank without the output layer: nothing to sample.
pub fn no_logits() -> Result<Array> {
    Ok(mlx_rs::ops::zeros::<f32>(&[0])?)
}

/// The error of a rank asked for a part it does not hold.
pub fn not_held(what: &str) -> EngineError {
    EngineError::Distributed(format!("this rank does not hold {what} (rank 0 does)"))
}

/// A follower's work: its layers for every forward rank 0 runs, on its copies of rank 0's
/// caches (kept by the log each forward brings), until rank 0 stops the pipeline. Returns the
/// forwards it ran.
pub fn follow(model: &dyn crate::models::LanguageModel, stage: &Stage) -> Result<usize> {
    let mut mirrors = crate::cache_mirror::Mirrors::default();
    // The forward reads only the received hidden state's shape; these ids are never embedded.
    let placeholder = Array::from_slice(&[0u32], &[1, 1]);
    let mut forwards = 0;
    while let Some(forward) = stage.next()? {
        mirrors.apply(&forward.log)?;
        let mut caches = mirrors.take(&forward.ids)?;
        let offset = caches.first().map_or(0, crate::cache::KvCache::offset);
        if forward.position != offset {
            return Err(protocol(format!(
                "rank 0 sent a chunk at position {}; this rank's copy ends at {offset}",
                forward.position
            )));
        }
        model.forward(&placeholder, &mut caches, forward.logits)?;
        crate::runtime::eval(caches.iter().flat_map(|cache| cache.state()))?;
        mirrors.put_back(&forward.ids, caches);
        forwards += 1;
    }
    Ok(forwards)
}
