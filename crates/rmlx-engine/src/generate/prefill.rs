//! A prompt's prefill, a bounded piece at a time, and where it snapshots its caches.

use std::time::Instant;

use mlx_rs::Array;

use crate::{
    cache::KvCache,
    chat::{ChatTokenizer, StopMatcher, StreamDecoder},
    constrain::{self, Grammars},
    error::{EngineError, Result},
    models::{LanguageModel, Logits, VisionFeatures},
    multimodal::{self, ImagePrefill},
    prefix_cache::Reuse,
    sample::Sampler,
};

use super::{
    as_input, effective_context, sequence::cancelled, CachedSequence, Completion, FinishReason,
    GenerateParams, Sequence, Timings, DEFAULT_PREFILL_CHUNK, MAX_TOP_LOGPROBS,
};

/// Prefill pieces at least this long give MLX's buffer cache back after they run.
const LONG_PIECE: usize = 256;
/// The most tokens one step of prompts prefilling together takes (each member's chunk, up to
/// this in all): it bounds the step's activations and a running stream's wait (8 default
/// chunks).
pub const GROUP_TOKENS: usize = 4096;
/// A prompt's prefill, one bounded piece at a time: the engine runs a piece of a new request
/// between decode steps of the running ones, so no stream waits longer than one piece.
pub struct Prefill {
    prompt_ids: Vec<u32>,
    params: GenerateParams,
    caches: Vec<KvCache>,
    cached_tokens: usize,
    max_ctx: usize,
    pieces: std::collections::VecDeque<std::ops::Range<usize>>,
    /// Prompt lengths whose recurrent state is snapshotted (empty for rewindable models).
    cuts: Vec<usize>,
    snapshots: Vec<CachedSequence>,
    images: Option<ImagePrefill>,
    started: Instant,
    /// The most prompts prefilled in one forward with this one (see [`step_together`]).
    prefilled_with: usize,
    /// The most prompts in a forward that took its image blocks (see `Timings`).
    images_prefilled_with: usize,
    /// Whether its image pieces may be a row of a group's forward (the model takes image
    /// chunks in a batch).
    images_group: bool,
    /// Its next piece is an image block that could not be taken whole beside a group's
    /// (see [`group_len`]): it runs alone before the prompt may group again.
    alone_next: bool,
}

impl Prefill {
    /// Checks the request (context, log-prob count, image blocks) before any compute and
    /// plans the pieces: all prompt tokens but the last, from the reused prefix on.
    pub fn new(
        model: &dyn LanguageModel,
        tokenizer: &ChatTokenizer,
        prompt_ids: &[u32],
        params: &GenerateParams,
        reuse: Option<Reuse>,
        images: Option<ImagePrefill>,
    ) -> Result<Self> {
        let started = images
            .as_ref()
            .and_then(|images| images.started)
            .unwrap_or_else(Instant::now);
        let max_ctx = effective_context(model, params, prompt_ids.len())?;
        if params.logprobs.is_some_and(|top| top > MAX_TOP_LOGPROBS) {
            return Err(EngineError::InvalidRequest(format!(
                "at most {MAX_TOP_LOGPROBS} top log-probs per token"
            )));
        }
        let (caches, cached_tokens) = match reuse {
            Some(reuse)
                if reuse.cached_tokens < prompt_ids.len()
                    && draft_caches_hold(model, &reuse.caches, reuse.cached_tokens) =>
            {
                let mut caches = reuse.caches;
                caches
                    .iter_mut()
                    .for_each(|cache| cache.set_max_ctx(max_ctx));
                // The draft model's caches set aside while the head's are aligned.
                let own = crate::models::draft_model::own_caches(model, caches.len());
                let mut draft_caches = caches.split_off(own);
                draft_caches
                    .iter_mut()
                    .for_each(|cache| cache.truncate(reuse.cached_tokens as i32));
                let next = prompt_ids[reuse.cached_tokens];
                align_head(model, &mut caches, reuse.cached_tokens, next, max_ctx)?;
                caches.append(&mut draft_caches);
                (caches, reuse.cached_tokens)
            }
            _ => {
                let mut caches = model.new_cache(max_ctx);
                caches
                    .iter_mut()
                    .filter(|cache| !cache.is_windowed())
                    .for_each(|cache| cache.set_storage(params.kv_storage));
                (caches, 0)
            }
        };
        let chunk = params.prefill_chunk.unwrap_or(DEFAULT_PREFILL_CHUNK).max(1);
        // Each piece is one bounded graph, evaluated before the next (the Metal watchdog kills
        // command buffers past ~10 s).
        let body = cached_tokens..prompt_ids.len() - 1;
        let (pieces, cuts) = match &images {
            Some(images) => {
                if model.as_vision().is_none() {
                    return Err(EngineError::InvalidRequest(
                        "this model has no vision: send text only".into(),
                    ));
                }
                multimodal::check_blocks(images, body.clone())?;
                let pieces = multimodal::plan_chunks(body.clone(), chunk, &images.blocks);
                // Snapshots at message boundaries here too (see below); they fall between
                // image blocks, never inside one.
                let cuts = snapshot_cuts(model, tokenizer, prompt_ids, body);
                let pieces = pieces
                    .into_iter()
                    .flat_map(|piece| {
                        let len = piece.len();
                        split_at_cuts(piece, len, &cuts)
                    })
                    .collect::<Vec<_>>();
                (pieces, cuts)
            }
            None => {
                let cuts = snapshot_cuts(model, tokenizer, prompt_ids, body.clone());
                (split_at_cuts(body, chunk, &cuts), cuts)
            }
        };
        Ok(Self {
            prompt_ids: prompt_ids.to_vec(),
            params: params.clone(),
            caches,
            cached_tokens,
            max_ctx,
            pieces: pieces.into(),
            cuts,
            snapshots: Vec::new(),
            images_group: model
                .as_vision()
                .is_some_and(|vision| vision.groups_images()),
            images,
            started,
            prefilled_with: 0,
            images_prefilled_with: 0,
            alone_next: false,
        })
    }

    pub fn is_done(&self) -> bool {
        self.pieces.is_empty()
    }

    /// Counts the request's time (TTFT, total) from `earlier`: a prefix read off the disk
    /// before this prefill was made is part of the wait for the first token.
    pub fn count_from(&mut self, earlier: Instant) {
        self.started = self.started.min(earlier);
    }

    /// When the request started (its place in the queue).
    pub fn started_at(&self) -> Instant {
        self.started
    }

    pub fn prompt_tokens(&self) -> usize {
        self.prompt_ids.len()
    }

    /// Tokens the answer may take: `max_tokens`, within the context.
    pub fn max_new(&self) -> usize {
        self.params
            .max_tokens
            .min(self.max_ctx - self.prompt_ids.len() + 1)
    }

    pub fn max_ctx(&self) -> usize {
        self.max_ctx
    }

    pub fn caches(&self) -> &[KvCache] {
        &self.caches
    }

    /// Whether its next piece may run as a row of a group's forward ([`step_together`]):
    /// text, or images where the model takes image chunks in a batch.
    pub fn groups(&self) -> bool {
        !self.pieces.is_empty() && !self.alone_next && (self.images.is_none() || self.images_group)
    }

    /// Whether its next piece must run alone (it left a group for it, see [`group_len`]).
    pub fn steps_alone(&self) -> bool {
        self.alone_next && !self.pieces.is_empty()
    }

    /// Its next piece runs alone (see [`group_len`]). Where text comes before the piece's image
    /// block, only that text does: the block then begins its next piece, where blocks of one
    /// length go in together.
    pub fn go_alone(&mut self) {
        self.alone_next = true;
        let Some(front) = self.pieces.front().cloned() else {
            return;
        };
        let block = self.images.as_ref().and_then(|images| {
            images
                .blocks
                .iter()
                .find(|block| block.start > front.start && block.end <= front.end)
                .cloned()
        });
        if let Some(block) = block {
            self.pieces.pop_front();
            self.pieces.push_front(block.start..front.end);
            self.pieces.push_front(front.start..block.start);
        }
    }

    /// Whether an image block still lies ahead of it (in its next piece or a later one): a
    /// member sent to step alone comes back nearer to it, and blocks of one length go in
    /// together; one with none ahead only ever comes back with more text.
    pub fn has_a_block_ahead(&self) -> bool {
        let (Some(front), Some(images)) = (self.pieces.front(), self.images.as_ref()) else {
            return false;
        };
        images.blocks.iter().any(|block| block.start >= front.start)
    }

    /// The image block a step taking its next `len` positions would cut.
    fn block_cut_by(&self, len: usize) -> Option<std::ops::Range<usize>> {
        let front = self.pieces.front()?;
        let end = front.start + len.min(front.len());
        self.images.as_ref()?.block_cut_at(front.start, end)
    }

    /// Its caches, taken out while they are a row of a group's (see [`step_together`]).
    pub fn take_caches(&mut self) -> Vec<KvCache> {
        std::mem::take(&mut self.caches)
    }

    /// Puts back its caches (its own row of a group's, copied out: bounded by what they hold,
    /// so they get the request's context back).
    pub fn put_caches(&mut self, mut caches: Vec<KvCache>) {
        caches
            .iter_mut()
            .for_each(|cache| cache.set_max_ctx(self.max_ctx));
        self.caches = caches;
    }

    /// Its prefill chunk: the most tokens a piece of it takes.
    pub fn chunk(&self) -> usize {
        self.params
            .prefill_chunk
            .unwrap_or(DEFAULT_PREFILL_CHUNK)
            .max(1)
    }

    /// The next `len` positions of its front piece (the rest of that piece stays in front).
    fn take_front(&mut self, len: usize) -> std::ops::Range<usize> {
        let front = self.pieces.front_mut().expect("checked: a piece is left");
        let taken = front.start..front.start + len.min(front.len());
        if taken.end == front.end {
            self.pieces.pop_front();
        } else {
            front.start = taken.end;
        }
        taken
    }

    /// Prefills the next piece and evaluates the caches.
    pub fn step(&mut self, model: &dyn LanguageModel) -> Result<()> {
        let Some(piece) = self.pieces.pop_front() else {
            return Ok(());
        };
        self.alone_next = false;
        // The draft head pairs each position with the token after it: the prompt's, since a
        // piece never ends at the last prompt token (the first decode step feeds it).
        let primed = model.draft_head().map(|head| {
            let next = as_input(&self.prompt_ids[piece.start + 1..=piece.end]);
            (head, next)
        });
        let primed = primed.as_ref().map(|(head, next)| (*head, next));
        let own = crate::models::draft_model::own_caches(model, self.caches.len());
        let (caches, draft_caches) = self.caches.split_at_mut(own);
        match (&self.images, model.as_vision()) {
            (Some(images), Some(vision)) => multimodal::prefill_piece(
                vision,
                primed,
                images,
                &self.prompt_ids,
                piece.clone(),
                caches,
            )?,
            _ => {
                let input = as_input(&self.prompt_ids[piece.clone()]);
                match primed {
                    Some((head, next)) => head.prime(&input, None, next, caches)?,
                    None => {
                        model.forward(&input, caches, Logits::None)?;
                    }
                }
            }
        }
        // A separate draft model takes in the same piece (token ids only: it sees no images).
        if let Some(draft) = model.draft_model() {
            let input = as_input(&self.prompt_ids[piece.clone()]);
            draft.model.forward(&input, draft_caches, Logits::Last)?;
        }
        crate::runtime::eval(self.caches.iter().flat_map(|cache| cache.state()))?;
        self.prefilled_with = self.prefilled_with.max(1);
        if let Some(images) = &self.images {
            if images.blocks_within(piece.clone()).is_some() {
                self.images_prefilled_with = self.images_prefilled_with.max(1);
            }
        }
        // A long piece's activations are not reused at their size (see clear_buffer_cache);
        // a short turn's few buffers stay for the decode steps after it.
        if piece.len() >= LONG_PIECE {
            crate::runtime::clear_buffer_cache();
        }
        if self.cuts.contains(&piece.end) {
            self.snapshots.push(CachedSequence {
                tokens: self.prompt_ids[..piece.end].to_vec(),
                caches: self.caches.clone(),
                snapshots: Vec::new(),
            });
        }
        Ok(())
    }

    /// A request cancelled before its first token: what it had prefilled goes back.
    pub fn cancelled(self) -> (Completion, CachedSequence) {
        let sequence = CachedSequence::new(&self.prompt_ids, &[], self.caches);
        (
            cancelled(&self.prompt_ids, self.cached_tokens, self.started),
            sequence,
        )
    }

    /// The decode state and the caches of a fully prefilled prompt.
    pub fn into_sequence(
        self,
        model: &dyn LanguageModel,
        tokenizer: &ChatTokenizer,
        grammars: Grammars,
    ) -> Result<(Sequence, Vec<KvCache>)> {
        let max_new = self.max_new();
        let params = self.params;
        let constraint = match grammars.format {
            Some(constraint) => Some(constraint),
            None => constrain::one_off_constraint(
                tokenizer,
                model.vocab_size(),
                &params.response_format,
            )?,
        };
        let tools = match grammars.tools.is_empty() {
            false => grammars.tools,
            true => constrain::one_off_tool_grammars(
                tokenizer,
                model.vocab_size(),
                &params.tool_grammars,
                params.reasoning_budget.as_ref(),
            )?,
        };
        let mut stop_ids: Vec<u32> = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stop_ids.extend_from_slice(tokenizer.eos_token_ids());
        }
        let last = *self
            .prompt_ids
            .last()
            .expect("checked: the prompt is not empty");
        let has_head = model.draft_head().is_some();
        let has_draft_model = model.draft_model().is_some();
        let seeded_sampling = !params.sampling.is_greedy() && params.sampling.seed.is_some();
        let (proposer, depth) = match crate::speculative::Proposer::new(
            &params.speculative,
            has_head,
            has_draft_model,
            seeded_sampling,
        ) {
            Some((proposer, depth)) => (Some(proposer), depth),
            None => (None, None),
        };
        let sequence = Sequence {
            sampler: Sampler::new(&params.sampling)?,
            constraint,
            tools,
            stop_ids,
            history: self.prompt_ids.clone(),
            decoder: StreamDecoder::new(tokenizer),
            stops: StopMatcher::new(params.stop.clone()),
            text: String::new(),
            token_ids: Vec::new(),
            logprobs: params.logprobs.map(|_| Vec::new()),
            timings: Timings {
                prefilled_with: self.prefilled_with,
                images_prefilled_with: self.images_prefilled_with,
                ..Timings::default()
            },
            started: self.started,
            last_token_at: self.started,
            max_new,
            context: self.max_ctx,
            prompt_ids: self.prompt_ids,
            cached_tokens: self.cached_tokens,
            snapshots: self.snapshots,
            queued: 0,
            unread: std::collections::VecDeque::new(),
            input: Array::from_slice(&[last as i32], &[1]),
            input_row: None,
            finish: (max_new == 0).then_some(FinishReason::Length),
            stop_sequence: None,
            document_complete: false,
            batched_with: 1,
            proposer,
            depth,
            drafted: 0,
            accepted: 0,
            drafted_at: Vec::new(),
            accepted_at: Vec::new(),
            head: Default::default(),
            params,
        };
        Ok((sequence, self.caches))
    }
}

/// How many positions every member of a group takes in its next step: the shortest next
/// piece, within `tokens` for the whole step, shortened to the text before any image block it
/// would cut. Blocks that begin members' pieces go in whole (a block is never split: its
/// positions and, on Gemma 4, its attention both ways need it whole): the most common length
/// among them, when it fits the step. `Err` names the members that cannot take that length (a
/// block of another length, a shorter piece, a block of theirs it would cut): each steps its
/// next piece alone ([`Prefill::go_alone`]) and then groups again.
pub fn group_len(
    members: &[&mut Prefill],
    tokens: usize,
) -> std::result::Result<usize, Vec<usize>> {
    let rows = members.len().max(1);
    let front = |member: &Prefill| member.pieces.front().cloned().unwrap_or(0..0);
    let shortest = members
        .iter()
        .map(|member| front(member).len())
        .min()
        .unwrap_or(1)
        .max(1);
    let mut len = shortest.min((tokens / rows).max(1));
    // Each pass only shortens `len`, so this ends.
    loop {
        let shorter = members
            .iter()
            .filter_map(|member| {
                let before = member.block_cut_by(len)?.start - front(member).start;
                (before > 0).then_some(before)
            })
            .min();
        match shorter {
            Some(before) if before < len => len = before,
            _ => break,
        }
    }
    let starting: Vec<usize> = members
        .iter()
        .filter_map(|member| member.block_cut_by(len).map(|block| block.len()))
        .collect();
    if starting.is_empty() {
        return Ok(len);
    }
    // The most common length of the blocks that begin pieces (the shortest of equals).
    let whole = starting
        .iter()
        .copied()
        .max_by_key(|&length| {
            let count = starting.iter().filter(|&&other| other == length).count();
            (count, std::cmp::Reverse(length))
        })
        .unwrap_or(len);
    let alone: Vec<usize> = (0..members.len())
        .filter(|&at| {
            let member = &members[at];
            let starts_other = member
                .block_cut_by(len)
                .is_some_and(|block| block.len() != whole);
            starts_other || front(member).len() < whole || member.block_cut_by(whole).is_some()
        })
        .collect();
    // Blocks over the step's budget go alone first: sending away the members that cannot
    // take them would not make them fit, and those members (a text prompt in pieces of one
    // chunk, shorter than such a block) come back to the same choice every step.
    if whole * rows > tokens {
        return Err((0..members.len())
            .filter(|&at| members[at].block_cut_by(len).is_some())
            .collect());
    }
    match alone.is_empty() {
        true => Ok(whole),
        false => Err(alone),
    }
}

/// Prompts prefilled together: the next piece of every member as one row of a single forward
/// over `caches`, their caches joined (row `b` is `members[b]`'s; see [`Prefill::groups`]).
/// Every row takes the same number of tokens, `len` from [`group_len`], so no row is padded;
/// rows holding image blocks take their features (in row order). A member whose piece ends at
/// one of its snapshot points gets its row copied out as the snapshot. Prompts that each
/// prefilled alone would cost a forward each (weights read again, kernels launched again),
/// with a decode step between them.
pub fn step_together(
    model: &dyn LanguageModel,
    members: &mut [&mut Prefill],
    caches: &mut [KvCache],
    len: usize,
) -> Result<()> {
    let rows = members.len();
    if len == 0 || members.iter().any(|member| member.pieces.is_empty()) {
        return Err(EngineError::InvalidRequest(
            "a group member has nothing to prefill".into(),
        ));
    }
    let ranges: Vec<std::ops::Range<usize>> = members
        .iter_mut()
        .map(|member| member.take_front(len))
        .collect();
    if ranges.iter().any(|range| range.len() != len) {
        return Err(EngineError::Internal(
            "a group step's rows took different lengths".into(),
        ));
    }
    let ids = |shift: usize| -> Array {
        let ids: Vec<i32> = members
            .iter()
            .zip(&ranges)
            .flat_map(|(member, range)| {
                member.prompt_ids[range.start + shift..range.end + shift]
                    .iter()
                    .map(|&id| id as i32)
            })
            .collect();
        Array::from_slice(&ids, &[rows as i32, len as i32])
    };
    let row_features: Vec<Option<VisionFeatures>> = members
        .iter()
        .zip(&ranges)
        .map(|(member, range)| member.images.as_ref()?.features_within(range.clone()))
        .collect();
    let with_images: Vec<bool> = row_features.iter().map(Option::is_some).collect();
    let features = multimodal::join_features(row_features)?;
    let input = ids(0);
    let own = crate::models::draft_model::own_caches(model, caches.len());
    let (trunk, draft_caches) = caches.split_at_mut(own);
    match (model.draft_head(), &features) {
        // Each position paired with the token after it (a piece never ends at the last prompt
        // token, so it is the prompt's).
        (Some(head), _) => head.prime(&input, features.as_ref(), &ids(1), trunk)?,
        (None, Some(features)) => {
            let vision = model.as_vision().ok_or_else(|| {
                EngineError::InvalidRequest("this model has no vision: send text only".into())
            })?;
            vision.forward_with_images(&input, Some(features), trunk, Logits::None)?;
        }
        (None, None) => {
            model.forward(&input, trunk, Logits::None)?;
        }
    }
    if let Some(draft) = model.draft_model() {
        draft.model.forward(&input, draft_caches, Logits::Last)?;
    }
    crate::runtime::eval(caches.iter().flat_map(|cache| cache.state()))?;
    if len * rows >= LONG_PIECE {
        crate::runtime::clear_buffer_cache();
    }
    for (row, (member, range)) in members.iter_mut().zip(&ranges).enumerate() {
        member.prefilled_with = member.prefilled_with.max(rows);
        if with_images[row] {
            let together = with_images.iter().filter(|&&held| held).count();
            member.images_prefilled_with = member.images_prefilled_with.max(together);
        }
        if member.cuts.contains(&range.end) {
            member.snapshots.push(CachedSequence {
                tokens: member.prompt_ids[..range.end].to_vec(),
                caches: caches
                    .iter()
                    .map(|cache| cache.row(row))
                    .collect::<Result<_>>()?,
                snapshots: Vec::new(),
            });
        }
    }
    Ok(())
}

/// Whether a reused prefix's caches suit this model: a separate draft model's caches must be
/// there and hold the prefix (they are settled before an entry is stored); otherwise the prompt
/// is prefilled afresh.
fn draft_caches_hold(model: &dyn LanguageModel, caches: &[KvCache], cached: usize) -> bool {
    let Some(draft) = model.draft_model() else {
        return true;
    };
    let own = crate::models::draft_model::own_caches(model, caches.len());
    caches.len() >= draft.caches
        && caches.len() == model.new_cache(1).len()
        && caches[own..]
            .iter()
            .all(|cache| cache.offset() >= cached as i32 && cache.can_truncate_to(cached as i32))
}

/// A reused prefix of `cached` tokens for a model with a draft head: the head's last entry
/// paired the trunk's hidden state at `cached - 1` with the token after it in the stored
/// conversation, which this prompt may not share, so it goes, and that position is re-paired
/// with this prompt's token `next` and a zero hidden state (the stored one is not kept; the
/// head then sees that token alone) right here, so the prompt's pieces prime as a fresh
/// prompt's do (and prefill in a group). A prefix whose head caches are missing or shorter
/// (stored without a head, or its last tokens never taken in) gets fresh head caches that start
/// at the right rotary position, with no history.
fn align_head(
    model: &dyn LanguageModel,
    caches: &mut Vec<KvCache>,
    cached: usize,
    next: u32,
    max_ctx: usize,
) -> Result<()> {
    let Some(head) = model.draft_head() else {
        return Ok(());
    };
    let trunk = model.num_layers();
    let keep = cached.saturating_sub(1) as i32;
    let whole = caches.len() == trunk + head.head_layers()
        && caches[trunk..].iter().all(|cache| cache.offset() >= keep);
    if whole {
        caches[trunk..]
            .iter_mut()
            .for_each(|cache| cache.truncate(keep));
    } else {
        let delta = caches.first().map_or(0, KvCache::rope_delta);
        caches.truncate(trunk);
        for _ in 0..head.head_layers() {
            let mut fresh = KvCache::new(max_ctx);
            fresh.set_rope_delta(keep + delta);
            caches.push(fresh);
        }
    }
    if cached > 0 {
        head.take_in_alone(&as_input(&[next]), &mut caches[trunk..])?;
        crate::runtime::eval(caches[trunk..].iter().flat_map(|cache| cache.state()))?;
    }
    Ok(())
}

/// Where a prefill snapshots its caches for the prefix cache. A recurrent state cannot be cut
/// back to a shorter prefix, so it is snapshotted where a later prompt is likely to diverge:
/// before each message of the rendered prompt and at the end of the prompt (turn N+1 of a chat
/// re-renders everything after its last unchanged message). A windowed model's caches can be
/// cut back only within their windows, which are large: it snapshots before the last message
/// and at the end. Models whose caches always cut back need none.
fn snapshot_cuts(
    model: &dyn LanguageModel,
    tokenizer: &ChatTokenizer,
    prompt: &[u32],
    body: std::ops::Range<usize>,
) -> Vec<usize> {
    if body.is_empty() || (model.rewindable() && !model.windowed()) {
        return Vec::new();
    }
    let mut cuts = snapshot_points(prompt, body, tokenizer.token_id(model.message_opener()));
    if model.rewindable() {
        let end = cuts.pop();
        cuts = cuts.pop().into_iter().chain(end).collect();
    }
    cuts
}

/// Prompt lengths to snapshot a recurrent model's state at, within `range` (the positions to
/// prefill): before every `message_start` token, and the end of the range.
pub(crate) fn snapshot_points(
    prompt: &[u32],
    range: std::ops::Range<usize>,
    message_start: Option<u32>,
) -> Vec<usize> {
    let mut cuts: Vec<usize> = (range.start + 1..range.end)
        .filter(|&at| Some(prompt[at]) == message_start)
        .collect();
    cuts.push(range.end);
    cuts
}

/// `range` in pieces of at most `chunk` positions that also end at every cut.
fn split_at_cuts(
    range: std::ops::Range<usize>,
    chunk: usize,
    cuts: &[usize],
) -> Vec<std::ops::Range<usize>> {
    let mut pieces = Vec::new();
    let mut start = range.start;
    while start < range.end {
        let mut end = (start + chunk.max(1)).min(range.end);
        if let Some(&cut) = cuts.iter().find(|&&cut| cut > start && cut < end) {
            end = cut;
        }
        pieces.push(start..end);
        start = end;
    }
    pieces
}

#[cfg(test)]
mod snapshot_tests {
    use super::*;

    #[test]
    fn pieces_end_at_every_message_boundary_and_stay_within_the_chunk() {
        // 7 = the message opener.
        let prompt = [7, 1, 2, 3, 7, 4, 5, 6, 7, 8, 9];
        let cuts = snapshot_points(&prompt, 0..10, Some(7));
        assert_eq!(cuts, vec![4, 8, 10]);
        assert_eq!(
            split_at_cuts(0..10, 3, &cuts),
            vec![0..3, 3..4, 4..7, 7..8, 8..10]
        );
        assert_eq!(split_at_cuts(0..10, 100, &cuts), vec![0..4, 4..8, 8..10]);
        // A reused prefix: only boundaries after it count.
        assert_eq!(snapshot_points(&prompt, 4..10, Some(7)), vec![8, 10]);
        assert_eq!(snapshot_points(&prompt, 0..10, None), vec![10]);
    }
}
