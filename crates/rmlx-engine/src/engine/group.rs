//! Prompts prefilled together: requests that arrive while others prefill (an agent fanning out,
//! a burst of users) take their pieces as rows of one forward instead of one forward each with
//! a decode step of the running rows between them. Their caches are joined once, when they
//! enter the group (left-padded as a batch's rows), and a row is copied out when its prompt is
//! done. Reference: mlx-lm's `BatchGenerator` prefills waiting prompts as one padded batch
//! (`--prompt-concurrency`); here rows take equal pieces, so none is padded on the right.

use std::{path::PathBuf, sync::atomic::Ordering};

use crate::{
    cache::KvCache,
    error::{EngineError, Result},
    generate::{self, Prefill},
};

use super::{
    admission::Admission,
    request::injected_panic,
    thread_loop::{EngineThread, Reach},
    Step,
};

/// Prompts prefilling together: `caches` holds row `b` of every layer for `members[b]`, whose
/// own prefill holds no caches meanwhile.
pub(super) struct Group {
    pub(super) key: PathBuf,
    pub(super) caches: Vec<KvCache>,
    pub(super) members: Vec<Admission>,
}

impl Group {
    /// The KV its rows can come to hold once prefilled and decoding (see `Batch::reach`).
    pub(super) fn reach(&self) -> Reach {
        self.members
            .iter()
            .map(|member| Reach::of(&member.prefill))
            .fold(Reach::default(), Reach::with)
    }
}

impl EngineThread {
    /// One piece of every member of the group, after the prompts that can have joined it; false
    /// when fewer than two prompts can prefill together (the solo step runs instead).
    pub(super) fn group_step(&mut self) -> bool {
        let waiting = self
            .admitting
            .iter()
            .filter(|admission| admission.prefill.groups())
            .count();
        let members = self.group.as_ref().map_or(0, |group| group.members.len());
        if members + waiting < 2 {
            return false;
        }
        if waiting > 0 && !self.enter_group() {
            return true;
        }
        // The others did not fit beside the first (long prompts): it goes on alone, its caches
        // its own still (a group of one never joined any), rather than copied out every step.
        if self
            .group
            .as_ref()
            .is_some_and(|group| group.members.len() < 2)
        {
            let Group {
                caches, members, ..
            } = self.group.take().expect("looked at above");
            for mut member in members {
                member.prefill.put_caches(caches.clone());
                self.admitting.push(member);
            }
            self.admitting
                .sort_by_key(|admission| admission.prefill.started_at());
            return false;
        }
        let Some(key) = self.group.as_ref().map(|group| group.key.clone()) else {
            return false;
        };
        if !self.models.contains_key(&key) {
            let group = self.group.take().expect("looked at above");
            for member in group.members {
                self.fail(member.ticket, EngineError::EngineStopped);
            }
            return true;
        }
        // Members that cannot take the step's length leave to step alone. Where one of them
        // has no image block ahead the rest step now: it would only come back with more text
        // and meet the same choice (a chat cut at every short message beside image blocks held
        // the group until it was prefilled). Leavers with a block ahead come back nearer to
        // it, to go in with the others' blocks: the group waits for them. Each pass removes a
        // member, so this ends.
        let stepped = loop {
            // A panic in the step leaves the joined caches in no known state: the members fail.
            self.grouping = true;
            let stepped = {
                let group = self.group.as_mut().expect("looked at above");
                let model = self.models[&key].loaded.model.as_ref();
                let mut prefills: Vec<&mut Prefill> = group
                    .members
                    .iter_mut()
                    .map(|member| &mut member.prefill)
                    .collect();
                // One forward over a chunk of every member (up to GROUP_TOKENS in all), then a
                // decode step of the running streams: they wait for one piece of each prompt,
                // never for whole prompts.
                let chunk = prefills.iter().map(|p| p.chunk()).min().unwrap_or(1);
                let tokens = (chunk * prefills.len()).min(generate::GROUP_TOKENS.max(chunk));
                match generate::group_len(&prefills, tokens) {
                    Ok(len) => Ok(generate::step_together(
                        model,
                        &mut prefills,
                        &mut group.caches,
                        len,
                    )),
                    Err(alone) => {
                        let text_only = alone.iter().any(|&at| !prefills[at].has_a_block_ahead());
                        // A group left with one member dissolves: that one goes alone too.
                        let everyone = text_only && prefills.len() - alone.len() < 2;
                        for (at, prefill) in prefills.iter_mut().enumerate() {
                            if everyone || alone.contains(&at) {
                                prefill.go_alone();
                            }
                        }
                        Err(text_only)
                    }
                }
            };
            self.grouping = false;
            let step_the_rest = match stepped {
                Ok(stepped) => break stepped,
                Err(text_only) => text_only,
            };
            let group = self.group.take().expect("looked at above");
            self.leave_group(group, |member| member.prefill.steps_alone());
            if self.group.is_none() || !step_the_rest {
                return true;
            }
        };
        let group = self.group.take().expect("looked at above");
        if let Err(error) = stepped {
            for member in group.members {
                self.fail(member.ticket, error.for_each_request());
            }
            return true;
        }
        self.leave_group(group, |member| member.prefill.is_done());
        true
    }

    /// Waiting prompts that can prefill together enter the group (made now if there is none),
    /// their caches joined to its rows, first come, first served: behind a prompt that cannot
    /// enter (its KV does not fit beside the group, or it cannot group), none does, so the
    /// group drains and that prompt goes next rather than wait while arrivals keep the group
    /// alive. False when joining failed (the group's members and the entrant fail: the caches
    /// may be half joined).
    fn enter_group(&mut self) -> bool {
        let mut at = 0;
        while at < self.admitting.len() {
            let waiting = &self.admitting[at];
            // Prefilled prompts wait for the batch (in arrival order, `join_prefilled`).
            if waiting.prefill.is_done() {
                at += 1;
                continue;
            }
            if !waiting.prefill.groups() || !self.group_fits(waiting) {
                break;
            }
            // Out of the queue first: an injected panic then costs only this request.
            let mut entrant = self.admitting.remove(at);
            injected_panic(entrant.ticket.panic_at, Step::Prefill);
            let caches = entrant.prefill.take_caches();
            let group = self.group.get_or_insert_with(|| Group {
                key: entrant.key.clone(),
                caches: Vec::new(),
                members: Vec::new(),
            });
            if group.members.is_empty() {
                group.caches = caches;
                group.members.push(entrant);
                continue;
            }
            self.grouping = true;
            let joined: Result<()> = group
                .caches
                .iter_mut()
                .zip(&caches)
                .try_for_each(|(rows, row)| rows.join(row));
            self.grouping = false;
            match joined {
                Ok(()) => group.members.push(entrant),
                Err(error) => {
                    let group = self.group.take().expect("joined above");
                    for member in group.members {
                        self.fail(member.ticket, error.for_each_request());
                    }
                    self.fail(entrant.ticket, error);
                    return false;
                }
            }
        }
        true
    }

    /// Whether `entrant` may join the group: its rows, padded to the longest prompt, stay within
    /// the KV a batch's rows may hold beside the batch (`kv_admits`, see `join_prefilled`).
    /// Prompts that prefilled one at a time never held more than one prompt's KV besides the
    /// batch; a group of long prompts would hold all of theirs at once.
    fn group_fits(&self, entrant: &Admission) -> bool {
        let Some(group) = &self.group else {
            return true;
        };
        let context = group
            .members
            .iter()
            .chain(std::iter::once(entrant))
            .map(|member| member.prefill.max_ctx())
            .min()
            .unwrap_or(usize::MAX);
        let entering = group.reach().with(Reach::of(&entrant.prefill));
        let batch = self.batch.as_ref().map(|batch| batch.reach());
        self.kv_admits(&group.key, context, entering, batch.unwrap_or_default())
    }

    /// Members cancelled meanwhile leave the group for the prefilling queue, where they end.
    pub(super) fn leave_group_cancelled(&mut self) {
        if let Some(group) = self.group.take() {
            self.leave_group(group, |member| member.ticket.cancel.load(Ordering::Relaxed));
        }
    }

    /// Members for which `leaves` holds get their rows back as caches of their own and go back
    /// to the prefilling queue (the prefilled then join the batch, the cancelled end); the rest
    /// stay (a group of one dissolves: its prompt goes on alone).
    fn leave_group(&mut self, mut group: Group, leaves: impl Fn(&Admission) -> bool) {
        let mut leaving: Vec<usize> = (0..group.members.len())
            .filter(|&b| leaves(&group.members[b]))
            .collect();
        if group.members.len() - leaving.len() < 2 {
            leaving = (0..group.members.len()).collect();
        }
        if leaving.is_empty() {
            self.group = Some(group);
            return;
        }
        // Each leaver's own rows, copied out before the others are kept.
        let rows: Vec<Result<Vec<KvCache>>> = leaving
            .iter()
            .map(|&b| group.caches.iter().map(|cache| cache.row(b)).collect())
            .collect();
        let keep: Vec<usize> = (0..group.members.len())
            .filter(|b| !leaving.contains(b))
            .collect();
        let kept = match keep.is_empty() {
            true => Ok(()),
            false => group
                .caches
                .iter_mut()
                .try_for_each(|cache| cache.retain_rows(&keep)),
        };
        let mut members: Vec<Option<Admission>> = group.members.into_iter().map(Some).collect();
        for (&b, own) in leaving.iter().zip(rows) {
            let mut member = members[b].take().expect("each leaves once");
            match own {
                Ok(caches) => {
                    member.prefill.put_caches(caches);
                    self.admitting.push(member);
                }
                Err(error) => self.fail(member.ticket, error),
            }
        }
        let staying: Vec<Admission> = members.into_iter().flatten().collect();
        match kept {
            Ok(()) if !staying.is_empty() => {
                self.group = Some(Group {
                    key: group.key,
                    caches: group.caches,
                    members: staying,
                })
            }
            Ok(()) => {}
            Err(error) => {
                for member in staying {
                    self.fail(member.ticket, error.for_each_request());
                }
            }
        }
        // Arrival order in the queue: the prefilled join the batch first come, first served.
        self.admitting
            .sort_by_key(|admission| admission.prefill.started_at());
    }
}
