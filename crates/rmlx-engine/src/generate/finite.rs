//! A debugging check for logits that are not numbers (`RMLX_CHECK_FINITE=1`): a NaN logit row
//! samples token 0, which reads as a wrong answer, not an error. Each decode step then also
//! computes which rows' logits hold a NaN, on the device with the step; the flags are read a
//! step later, once that step's tokens were (no extra wait: a race that a wait would hide stays
//! visible), and a NaN row is reported with the token it was fed, its length, the batch it ran
//! in and which caches hold NaNs, to find where it began.

use std::{cell::RefCell, sync::OnceLock, time::Instant};

use mlx_rs::{ops::indexing::IndexOp, Array};

use crate::{cache::KvCache, error::Result};

use super::batch::DecodeRow;

pub(super) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("RMLX_CHECK_FINITE").is_ok_and(|v| v == "1"))
}

/// One row of one step: its request (start time and prompt length), its length then, the
/// rows of the step, whether its logits held a NaN (`[]` bool) and the token it was fed.
struct Checked {
    request: (Instant, usize),
    length: usize,
    rows: usize,
    nan: Array,
    input: Array,
}

thread_local! {
    static PENDING: RefCell<Vec<Checked>> = const { RefCell::new(Vec::new()) };
}

/// Reports the NaN rows of the steps before this one, then keeps this step's (`logits`
/// `[B, vocab]`, `input` `[B, 1]`) for the next call; returns the arrays to evaluate with the
/// step.
pub(super) fn check<R: DecodeRow>(
    logits: &Array,
    input: &Array,
    caches: &[KvCache],
    rows: &mut [R],
) -> Result<Vec<Array>> {
    let earlier = PENDING.with(|pending| std::mem::take(&mut *pending.borrow_mut()));
    report(earlier, caches)?;
    let flags = logits.is_nan()?.any_axes(&[-1], false)?;
    let count = rows.len();
    let mut queued = vec![flags.clone()];
    let mut checked = Vec::with_capacity(count);
    for (b, row) in rows.iter_mut().enumerate() {
        let sequence = row.sequence();
        let b = b as i32;
        let fed = input.index((b, 0));
        queued.push(fed.clone());
        checked.push(Checked {
            request: (sequence.started, sequence.prompt_ids.len()),
            length: sequence.history.len(),
            rows: count,
            nan: flags.index(b),
            input: fed,
        });
    }
    PENDING.with(|pending| *pending.borrow_mut() = checked);
    Ok(queued)
}

fn report(checked: Vec<Checked>, caches: &[KvCache]) -> Result<()> {
    if checked.is_empty() {
        return Ok(());
    }
    crate::runtime::eval(checked.iter().flat_map(|c| [&c.nan, &c.input]))?;
    let bad: Vec<&Checked> = checked
        .iter()
        .filter(|c| c.nan.try_item_cast::<bool>().unwrap_or(false))
        .collect();
    if bad.is_empty() {
        return Ok(());
    }
    for c in &bad {
        eprintln!(
            "rmlx: NaN logits: request started {:?} ago ({} prompt tokens), length {}, fed token \
             {}, in a step of {} rows",
            c.request.0.elapsed(),
            c.request.1,
            c.length,
            c.input.try_item_cast::<i64>().unwrap_or(-1),
            c.rows
        );
    }
    let first = caches.first();
    eprintln!(
        "rmlx:   now: cache 0 offset {:?} base {:?} row ends {:?}",
        first.map(KvCache::offset),
        first.map(KvCache::base),
        first.map(KvCache::row_offsets),
    );
    for (layer, cache) in caches.iter().enumerate() {
        let mut found = Vec::new();
        for (part, array) in cache.state().into_iter().enumerate() {
            let per_row = array
                .is_nan()?
                .reshape(&[array.shape()[0], -1])?
                .any_axes(&[-1], false)?;
            crate::runtime::eval([&per_row])?;
            let rows: Vec<usize> = per_row
                .as_slice::<bool>()
                .iter()
                .enumerate()
                .filter_map(|(b, &nan)| nan.then_some(b))
                .collect();
            if !rows.is_empty() {
                found.push(format!("part {part} rows {rows:?}"));
            }
        }
        if !found.is_empty() {
            eprintln!("rmlx:   cache {layer}: NaN in {}", found.join(", "));
        }
    }
    Ok(())
}
