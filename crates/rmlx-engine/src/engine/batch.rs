//! One model's running batch: prefill steps join it, decode steps run it, finished requests
//! leave it.

use std::{
    path::{Path, PathBuf},
    sync::{atomic::Ordering, mpsc},
};

use crate::{
    cache::KvCache,
    error::EngineError,
    generate::{self, Completion, DecodeRow, FinishReason, Sequence},
};

use super::{
    admission::Admission,
    images::image_keyed,
    request::injected_panic,
    thread_loop::{EngineThread, Reach},
    ticket::Ticket,
    Event, Step,
};

/// One model's running requests: `rows[b]` owns row `b` of every layer's cache.
pub(super) struct Batch {
    pub(super) key: PathBuf,
    /// The first row's context: the rows may hold this many positions of KV together, more
    /// where memory allows (`EngineThread::kv_admits`).
    pub(super) context: usize,
    pub(super) caches: Vec<KvCache>,
    pub(super) rows: Vec<Row>,
}

impl Batch {
    /// Columns every row's KV spans (the padded length).
    fn columns(&self) -> usize {
        self.caches
            .first()
            .map_or(0, |cache| cache.offset().max(0) as usize)
    }

    /// The KV its rows can come to hold.
    pub(super) fn reach(&self) -> Reach {
        let growth = self.rows.iter().map(|row| row.sequence.remaining()).max();
        Reach {
            rows: self.rows.len(),
            columns: self.columns(),
            growth: growth.unwrap_or(0),
        }
    }
}

pub(super) struct Row {
    sequence: Sequence,
    ticket: Ticket,
}

impl DecodeRow for Row {
    fn sequence(&mut self) -> &mut Sequence {
        &mut self.sequence
    }
    fn cancelled(&self) -> bool {
        self.ticket.cancel.load(Ordering::Relaxed)
    }
    fn emit(&mut self, delta: generate::Delta) {
        send_delta(&self.ticket.events, delta);
    }
}

fn send_delta(events: &mpsc::Sender<Event>, delta: generate::Delta) {
    let _ = events.send(Event::Delta {
        token_id: delta.token_id,
        text: delta.text,
        logprob: delta.logprob,
    });
}

impl EngineThread {
    /// One prefill step: cancelled prompts end, then the prompts that can prefill together
    /// take one piece each in one forward (`group.rs`), or else the first prompt takes one
    /// piece alone; prefilled prompts join the batch.
    pub(super) fn prefill_step(&mut self) {
        self.leave_group_cancelled();
        self.end_cancelled_prefills();
        // An image block that left a group goes first, so the group takes its prompt back soon.
        if let Some(at) = self
            .admitting
            .iter()
            .position(|admission| admission.prefill.steps_alone())
        {
            self.solo_prefill_step_of(at);
        } else if !self.group_step() {
            self.solo_prefill_step();
        }
        self.join_prefilled();
    }

    /// Prompts cancelled while prefilling (or waiting, prefilled) end; what they had goes back.
    fn end_cancelled_prefills(&mut self) {
        let mut index = 0;
        while index < self.admitting.len() {
            if !self.admitting[index].ticket.cancel.load(Ordering::Relaxed) {
                index += 1;
                continue;
            }
            let admission = self.admitting.remove(index);
            let (completion, _) = admission.prefill.cancelled();
            self.finish_request(&admission.key, admission.ticket, completion, None);
        }
    }

    /// One piece of the first prompt still prefilling, alone.
    fn solo_prefill_step(&mut self) {
        if let Some(at) = self
            .admitting
            .iter()
            .position(|admission| !admission.prefill.is_done())
        {
            self.solo_prefill_step_of(at);
        }
    }

    /// One piece of the prompt at `at` in the queue, alone.
    fn solo_prefill_step_of(&mut self, at: usize) {
        let mut admission = self.admitting.remove(at);
        injected_panic(admission.ticket.panic_at, Step::Prefill);
        let Some(resident) = self.models.get(&admission.key) else {
            self.fail(admission.ticket, EngineError::EngineStopped);
            return;
        };
        if let Err(error) = admission.prefill.step(resident.loaded.model.as_ref()) {
            self.fail(admission.ticket, error);
            return;
        }
        self.admitting.insert(at, admission);
    }

    /// Prefilled prompts join the batch in arrival order; one whose padded rows would take the
    /// batch past the KV it may hold (`kv_admits`) waits (and the later ones with it) until
    /// rows leave.
    fn join_prefilled(&mut self) {
        while let Some(at) = self
            .admitting
            .iter()
            .position(|admission| admission.prefill.is_done())
        {
            if let Some(batch) = &self.batch {
                let prefill = &self.admitting[at].prefill;
                let entrant = Reach::row(prefill.caches()[0].offset() as usize, prefill.max_new());
                let group = self.group.as_ref().map(|group| group.reach());
                let entering = batch.reach().with(entrant);
                if !self.kv_admits(
                    &batch.key,
                    batch.context,
                    entering,
                    group.unwrap_or_default(),
                ) {
                    return;
                }
            }
            let admission = self.admitting.remove(at);
            self.join_batch(admission);
        }
    }

    /// A prefilled prompt's decode state and caches join the batch (or start it).
    fn join_batch(&mut self, admission: Admission) {
        let Some(resident) = self.models.get(&admission.key) else {
            self.fail(admission.ticket, EngineError::EngineStopped);
            return;
        };
        let model = resident.loaded.model.as_ref();
        let Admission {
            key,
            ticket,
            prefill,
            constraint,
        } = admission;
        let (sequence, caches) = match prefill.into_sequence(model, &resident.tokenizer, constraint)
        {
            Ok(parts) => parts,
            Err(error) => return self.fail(ticket, error),
        };
        let row = Row { sequence, ticket };
        match self.batch.as_mut() {
            None => {
                self.batch = Some(Batch {
                    key,
                    context: row.sequence.context(),
                    caches,
                    rows: vec![row],
                })
            }
            Some(batch) => {
                self.joining = true;
                let joined = batch
                    .caches
                    .iter_mut()
                    .zip(&caches)
                    .try_for_each(|(running, new)| running.join(new));
                self.joining = false;
                match joined {
                    Ok(()) => batch.rows.push(row),
                    Err(error) => {
                        // The batch's caches may be half joined: every request in it fails.
                        let batch = self.batch.take().expect("matched above");
                        for row in batch.rows {
                            self.fail(row.ticket, error.for_each_request());
                        }
                        self.fail(row.ticket, error);
                    }
                }
            }
        }
    }

    /// One decode step of the batch, then the requests that ended leave it.
    pub(super) fn decode_step(&mut self) {
        let Some(mut batch) = self.batch.take() else {
            return;
        };
        for row in &batch.rows {
            injected_panic(row.ticket.panic_at, Step::Decode);
        }
        let Some(resident) = self.models.get(&batch.key) else {
            for row in batch.rows {
                self.fail(row.ticket, EngineError::EngineStopped);
            }
            return;
        };
        let model = resident.loaded.model.as_ref();
        let tokenizer = &resident.tokenizer;
        if let Err(error) =
            generate::decode_iteration(model, tokenizer, &mut batch.caches, &mut batch.rows)
        {
            for row in batch.rows {
                self.fail(row.ticket, error.for_each_request());
            }
            return;
        }
        if !batch.rows.iter().any(|row| row.sequence.is_finished()) {
            self.batch = Some(batch);
            return;
        }
        let single = batch.rows.len() == 1;
        let mut keep = Vec::new();
        let mut ended = Vec::new();
        for (index, row) in std::mem::take(&mut batch.rows).into_iter().enumerate() {
            if row.sequence.is_finished() {
                ended.push((index, row));
            } else {
                keep.push(index);
                batch.rows.push(row);
            }
        }
        let mut finished = Vec::new();
        for (index, row) in ended {
            // Only a request whose KV can be reused takes its row out of the batch.
            let reusable = row.ticket.keep_kv && !row.ticket.cancel.load(Ordering::Relaxed);
            let caches = if !reusable {
                Ok(Vec::new())
            } else if single && !batch.caches.iter().any(KvCache::is_batched) {
                Ok(std::mem::take(&mut batch.caches))
            } else {
                // A batched cache's arrays are slices of bigger buffers (rows and padding
                // dropped): the prefix cache gets a copy of just this row, so its byte count
                // is what it holds.
                batch.caches.iter().map(|cache| cache.row(index)).collect()
            };
            let Row {
                sequence,
                mut ticket,
            } = row;
            match caches {
                Ok(caches) => {
                    let mut emit = |delta: generate::Delta| send_delta(&ticket.events, delta);
                    let (completion, cached) = sequence.finish(model, tokenizer, caches, &mut emit);
                    ticket.keep_kv &= reusable;
                    finished.push((ticket, completion, cached));
                }
                Err(error) => self.fail(ticket, error),
            }
        }
        let key = batch.key.clone();
        if keep.is_empty() {
            self.batch = None;
        } else {
            match batch
                .caches
                .iter_mut()
                .try_for_each(|cache| cache.retain_rows(&keep))
            {
                Ok(()) => self.batch = Some(batch),
                Err(error) => {
                    for row in batch.rows {
                        self.fail(row.ticket, error.for_each_request());
                    }
                }
            }
        }
        for (ticket, completion, cached) in finished {
            self.finish_request(&key, ticket, completion, Some(cached));
        }
    }

    /// Records a finished request, offers its KV (and snapshots) to the prefix cache, and
    /// tells the client.
    pub(super) fn finish_request(
        &mut self,
        key: &Path,
        mut ticket: Ticket,
        completion: Completion,
        cached: Option<generate::CachedSequence>,
    ) {
        if !ticket.warm_up {
            self.metrics.record_completion(
                &ticket.model_id,
                ticket.request_id.as_deref(),
                &completion,
            );
        }
        // A warm-up row still comes out of the batch as a kept one would (its copy is a shape
        // to build too), and is then dropped.
        let reusable = completion.finish_reason != FinishReason::Cancelled
            && ticket.keep_kv
            && !ticket.warm_up;
        // For the disk, after the client has its answer (clones share the arrays).
        let mut for_disk = None;
        if let (true, Some(sequence)) = (reusable, cached) {
            let keyed = |tokens: Vec<u32>| image_keyed(tokens, ticket.image_key.as_deref());
            if self.disk.is_some() {
                for_disk = Some(self.disk_offer(key, &sequence, keyed(sequence.tokens.clone())));
            }
            self.prefix
                .retire_windowed_prefixes(key, &keyed(sequence.tokens.clone()));
            let mut evicted = 0;
            for snapshot in sequence.snapshots {
                evicted += self
                    .prefix
                    .insert(key, keyed(snapshot.tokens), snapshot.caches);
            }
            evicted += self
                .prefix
                .insert(key, keyed(sequence.tokens), sequence.caches);
            self.metrics
                .record_prefix_evictions(&ticket.model_id, evicted);
            self.prefix_ids
                .insert(key.to_path_buf(), ticket.model_id.clone());
        }
        self.publish_prefix_usage();
        ticket.settle();
        self.publish_in_flight();
        ticket.send_last(Event::Done(completion));
        if let Some(offer) = for_disk {
            self.offer_to_disk(key, offer);
        }
    }
}
