//! Admission: a request is rendered, checked and matched to a cached prefix, then waits for
//! a disk read or begins its prefill.

use std::{
    path::{Path, PathBuf},
    sync::atomic::Ordering,
};

use crate::{
    constrain::Grammars,
    error::{EngineError, Result},
    generate::{self, Prefill},
    metrics::PrefixSource,
    prefix_cache,
};

use super::{
    images::{image_key, outside_blocks, prepare_images},
    request::injected_panic,
    thread_loop::EngineThread,
    ticket::{settle, Ticket},
    Event, Job, Prompt, Request, Step,
};

/// A request waiting for the disk cache's reader (see [`EngineThread::start`]).
pub(super) struct Loading {
    read: u64,
    request: Request,
    ticket: Ticket,
    /// When the request was first admitted: its TTFT counts the read.
    admitted: std::time::Instant,
    /// Its prompt as rendered then.
    rendered: Vec<u32>,
}

/// What [`EngineThread::start`] made of a request: its prefill, or a disk read to wait for.
// Made and moved once per request: the size difference costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
enum Started {
    Prefill(PathBuf, Prefill, Grammars, Option<Vec<u32>>),
    /// The plan, and the prompt as rendered (before images are placed).
    Read(crate::disk_cache::Plan, Vec<u32>),
}

pub(super) struct Admission {
    pub(super) key: PathBuf,
    pub(super) ticket: Ticket,
    pub(super) prefill: Prefill,
    pub(super) constraint: Grammars,
}

impl EngineThread {
    /// Handles jobs at the head of the queue while they can go now: a request joins when no
    /// other prompt is prefilling and the batch runs its model with room to spare; a job that
    /// needs another model (or to unload the running one) waits until the batch drains, and
    /// everything behind it waits too.
    pub(super) fn admit(&mut self) {
        if let Some(disk) = &self.disk {
            for loaded in disk.poll() {
                self.take_read(loaded);
            }
        }
        // Requests whose prefix came off the disk go first (they arrived before anything
        // pending); one that cannot go yet holds the queue, as a pending job would (after the
        // cancelled give back their places below).
        let mut ready_blocked = false;
        while let Some((loading, _)) = self.ready.front() {
            // Cancelled while it waited for the batch: it ends here, holding nothing up (and
            // loading no model for a client that left).
            if loading.ticket.cancel.load(Ordering::Relaxed) {
                let (loading, _) = self.ready.pop_front().expect("looked at above");
                self.end_cancelled_wait(loading.ticket);
                continue;
            }
            if !self.batch_takes(&loading.request.model) {
                ready_blocked = true;
                break;
            }
            let (loading, loaded) = self.ready.pop_front().expect("looked at above");
            let Loading {
                request,
                mut ticket,
                admitted,
                rendered,
                ..
            } = loading;
            match self.start(&request, Some((loaded, rendered))) {
                Ok(Started::Prefill(key, mut prefill, constraint, image_key)) => {
                    prefill.count_from(admitted);
                    ticket.image_key = image_key;
                    self.begin(key, ticket, prefill, constraint)
                }
                Ok(Started::Read(..)) => unreachable!("a read prefix is never read again"),
                Err(error) => self.fail(ticket, error),
            }
        }
        // Requests cancelled anywhere in the queue give back their places now, not when the
        // head moves: a head waiting for another model's batch to drain held them, and the
        // queue refused new requests meanwhile.
        let before = self.pending.len();
        let queued = &self.queued;
        self.pending.retain(|job| match job {
            Job::Generate { cancel, .. } if cancel.load(Ordering::Relaxed) => {
                settle(queued);
                false
            }
            _ => true,
        });
        self.waiting
            .fetch_sub(before - self.pending.len(), Ordering::SeqCst);
        if ready_blocked {
            return;
        }
        while let Some(job) = self.pending.front() {
            let busy = self.batch.is_some() || self.prefilling() > 0;
            let running = self.running_key().cloned();
            let running = running.as_ref();
            match job {
                Job::Generate { cancel, .. } if cancel.load(Ordering::Relaxed) => {}
                Job::Generate { .. } if self.held() => return,
                Job::Generate { request, .. } => {
                    if !self.batch_takes(&request.model) {
                        return;
                    }
                }
                Job::Info { model, .. } => {
                    let resident = model
                        .canonicalize()
                        .is_ok_and(|key| self.models.contains_key(&key));
                    if busy && !resident {
                        return;
                    }
                }
                Job::Unload { model, .. } => {
                    let key = model.canonicalize().ok();
                    if running.is_some() && key.as_ref() == running {
                        return;
                    }
                }
                Job::Wake => {}
            }
            let job = self.pending.pop_front().expect("looked at above");
            match job {
                Job::Generate {
                    request,
                    events,
                    cancel,
                } => {
                    self.waiting.fetch_sub(1, Ordering::SeqCst);
                    if cancel.load(Ordering::Relaxed) {
                        settle(&self.queued);
                        continue;
                    }
                    let mut ticket = Ticket {
                        events,
                        cancel,
                        model_id: request.metrics_id(),
                        request_id: request.request_id.clone(),
                        keep_kv: true,
                        image_key: None,
                        queued: self.queued.clone(),
                        metrics: self.metrics.clone(),
                        closed: false,
                        panic_at: request.panic_at,
                        warm_up: request.warm_up,
                    };
                    injected_panic(ticket.panic_at, Step::Admit);
                    match self.start(&request, None) {
                        Ok(Started::Prefill(key, prefill, constraint, image_key)) => {
                            ticket.image_key = image_key;
                            self.begin(key, ticket, prefill, constraint)
                        }
                        Ok(Started::Read(plan, rendered)) => {
                            let read = self.disk.as_mut().expect("planned").request(&plan);
                            self.loading.push(Loading {
                                read,
                                request: *request,
                                ticket,
                                admitted: std::time::Instant::now(),
                                rendered,
                            });
                        }
                        Err(error) => self.fail(ticket, error),
                    }
                }
                Job::Info { model, reply } => {
                    let _ = reply.send(self.resident(&model).map(|r| r.loaded.info.clone()));
                }
                Job::Unload { model, reply } => {
                    let _ = reply.send(self.unload(&model));
                }
                Job::Wake => {}
            }
        }
    }

    /// Whether a request for `model` may start now: nothing runs, or the batch and the prompts
    /// prefilling run that model and, with them, it fits the batch's rows and the KV they hold
    /// leaves room (`kv_takes_another`). Prompts then prefill side by side (together where they
    /// can, see `group.rs`).
    fn batch_takes(&self, model: &Path) -> bool {
        let Some(running) = self.running_key() else {
            return true;
        };
        let rows = self.batch.as_ref().map_or(0, |batch| batch.rows.len());
        model.canonicalize().ok().as_ref() == Some(running)
            && rows + self.prefilling() < self.max_batch
            && self.kv_takes_another(running)
    }

    /// The model the batch or the prompts prefilling run.
    pub(super) fn running_key(&self) -> Option<&PathBuf> {
        self.batch
            .as_ref()
            .map(|batch| &batch.key)
            .or(self.admitting.first().map(|admission| &admission.key))
            .or(self.group.as_ref().map(|group| &group.key))
    }

    /// Requests prefilling or prefilled and waiting to join the batch.
    pub(super) fn prefilling(&self) -> usize {
        self.admitting.len() + self.group.as_ref().map_or(0, |group| group.members.len())
    }

    /// A request's prefill begins: the client learns its prompt's size.
    fn begin(&mut self, key: PathBuf, ticket: Ticket, prefill: Prefill, constraint: Grammars) {
        let _ = ticket.events.send(Event::Started {
            prompt_tokens: prefill.prompt_tokens(),
            max_ctx: prefill.max_ctx(),
        });
        self.admitting.push(Admission {
            key,
            ticket,
            prefill,
            constraint,
        });
    }

    /// A disk read finished: its request is ready to start (or, cancelled meanwhile, ends).
    pub(super) fn take_read(&mut self, loaded: crate::disk_cache::store::Loaded) {
        let Some(at) = self.loading.iter().position(|l| l.read == loaded.id) else {
            return;
        };
        let loading = self.loading.swap_remove(at);
        if loading.ticket.cancel.load(Ordering::Relaxed) {
            self.end_cancelled_wait(loading.ticket);
            return;
        }
        self.ready.push_back((loading, loaded));
    }

    /// A request cancelled before it started (its client left): it only gives back its place.
    fn end_cancelled_wait(&self, mut ticket: Ticket) {
        ticket.settle();
        self.publish_in_flight();
    }

    pub(super) fn fail(&self, mut ticket: Ticket, error: EngineError) {
        self.metrics.record_error(error.kind());
        ticket.settle();
        self.publish_in_flight();
        ticket.send_last(Event::Error(error));
    }

    /// Everything before the first prefill chunk: the model resident, the prompt rendered
    /// and checked against the context, the images encoded, the prefix cache consulted.
    /// Renders and checks a request and looks for its prefix: in RAM, else on disk (a read to
    /// wait for, unless `read` already holds what the disk had for it).
    fn start(
        &mut self,
        request: &Request,
        read: Option<(crate::disk_cache::store::Loaded, Vec<u32>)>,
    ) -> Result<Started> {
        let model_id = request.metrics_id();
        self.resident(&request.model)?;
        let key = self.lru.last().expect("just made resident").clone();
        let fingerprint = self.fingerprint(&key);
        // Before any compute: a bad schema is the request's error.
        let constraint = self
            .models
            .get_mut(&key)
            .expect("just made resident")
            .grammars(&request.params)?;
        let resident = &self.models[&key];
        let tokenizer = &resident.tokenizer;
        // Before rendering: a text-only template may not even accept image parts.
        if !request.images.is_empty() && resident.loaded.model.as_vision().is_none() {
            return Err(EngineError::InvalidRequest(format!(
                "this model ({}) has no vision: send text only",
                resident.loaded.info.model_type
            )));
        }
        let prefill = request.assistant_prefill.as_deref().unwrap_or("");
        // A request back from a disk read keeps its rendering (a long prompt's template and
        // tokenizer take a while).
        let (read, rendered) = match read {
            Some((loaded, rendered)) => (Some(loaded), Some(rendered)),
            None => (None, None),
        };
        let prompt_ids = match (rendered, &request.prompt) {
            (Some(rendered), _) => rendered,
            (None, Prompt::Chat { messages, options }) => {
                tokenizer
                    .encode_chat_prefilled(messages, options, prefill)?
                    .1
            }
            (None, Prompt::Text(text)) => tokenizer.encode_plain(&format!("{text}{prefill}"))?,
            (None, Prompt::Ids(ids)) => [ids.clone(), tokenizer.encode(prefill, false)?].concat(),
        };
        // With images the prompt is expanded below; a disk read needs it as rendered.
        let rendered = (!request.images.is_empty()).then(|| prompt_ids.clone());
        let model = resident.loaded.model.as_ref();
        let vocab = model.vocab_size() as u32;
        if let Some(bad) = prompt_ids.iter().find(|&&id| id >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary ({vocab})"
            )));
        }
        // The sampler would find it only at the first decode step, failing the whole batch.
        if let Some(&bad) = request
            .params
            .sampling
            .logit_bias
            .keys()
            .find(|&&id| id >= vocab)
        {
            return Err(EngineError::Sample(
                crate::sample::SampleError::TokenOutOfRange {
                    token: bad,
                    vocab: vocab as usize,
                    what: "logit_bias",
                },
            ));
        }
        let (prompt_ids, images) = if request.images.is_empty() {
            (prompt_ids, None)
        } else {
            let started = std::time::Instant::now();
            // Count the image tokens from the image sizes alone: a prompt over the context is
            // refused before any resize, vision tower or prefill work.
            let counted = crate::multimodal::place_images(
                &resident.loaded.info.path,
                &resident.loaded.info.model_type,
                tokenizer,
                prompt_ids.clone(),
                &request.images,
                request.image_soft_tokens,
                false,
            )?;
            generate::effective_context(model, &request.params, counted.ids.len())?;
            let prepared =
                prepare_images(&resident.loaded, tokenizer, prompt_ids, request, started)?;
            (prepared.0, Some(prepared.1))
        };
        generate::effective_context(model, &request.params, prompt_ids.len())?;
        // Image soft tokens are one id for every image: the cache keys them by their pixels.
        let image_key = images
            .as_ref()
            .map(|pending| image_key(&prompt_ids, &pending.spans, &request.images));
        let lookup_key = image_key.as_deref().unwrap_or(&prompt_ids);
        let blocks = images
            .as_ref()
            .map_or(&[][..], |pending| &pending.blocks[..]);
        // The warm-up computes every prompt in full: a reused prefix would skip its shapes.
        let mut reuse = match request.warm_up {
            true => None,
            false => self.prefix.lookup(&key, lookup_key),
        }
        .and_then(|reuse| outside_blocks(reuse, blocks));
        let in_ram = reuse.as_ref().map_or(0, |reuse| reuse.cached_tokens);
        let mut source = match reuse {
            Some(_) => PrefixSource::Ram,
            None => PrefixSource::None,
        };
        match (read, &self.disk, &fingerprint) {
            (Some(read), _, _) => {
                let fresh = model.new_cache(model.max_position_embeddings());
                let rebuilt = crate::disk_cache::restore::rebuild(fresh, &read.files, lookup_key);
                match rebuilt {
                    Ok((caches, tokens)) if tokens > in_ram => {
                        let from_disk = prefix_cache::Reuse {
                            caches,
                            cached_tokens: tokens,
                        };
                        if let Some(from_disk) = outside_blocks(from_disk, blocks) {
                            reuse = Some(from_disk);
                            source = PrefixSource::Disk;
                        }
                    }
                    Ok(_) => {}
                    Err(error) => eprintln!("rmlx: a disk-cache prefix was not used: {error}"),
                }
            }
            (None, Some(disk), Some(fingerprint)) if !request.warm_up => {
                let needs_tip = !model.rewindable() || model.windowed();
                if let Some(plan) = disk.plan(fingerprint, lookup_key, needs_tip) {
                    if plan.tokens > in_ram {
                        let rendered = rendered.unwrap_or_else(|| prompt_ids.clone());
                        return Ok(Started::Read(plan, rendered));
                    }
                }
            }
            _ => {}
        }
        if !request.warm_up {
            self.metrics.record_prefix_lookup(&model_id, source);
        }
        // Images wholly inside the reused prefix need no vision tower.
        let cached = reuse.as_ref().map_or(0, |reuse| reuse.cached_tokens);
        let images = match images {
            Some(pending) => {
                let first = pending
                    .blocks
                    .iter()
                    .take_while(|b| b.end <= cached)
                    .count();
                pending.encode(first)?
            }
            None => None,
        };
        let resident = &self.models[&key];
        let mut params = request.params.clone();
        params.kv_storage = self.kv_storage;
        params.speculative.mode.get_or_insert(self.speculative);
        params
            .speculative
            .costs
            .get_or_insert_with(|| resident.step_costs.clone());
        let prefill = Prefill::new(
            resident.loaded.model.as_ref(),
            &resident.tokenizer,
            &prompt_ids,
            &params,
            reuse,
            images,
        )?;
        Ok(Started::Prefill(key, prefill, constraint, image_key))
    }
}
