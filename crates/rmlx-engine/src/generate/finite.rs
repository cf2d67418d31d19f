//! A debugging check for logits that are not numbers (`RMLX_CHECK_FINITE=1`): a NaN logit row
//! samples token 0, which reads as a wrong answer, not an error. Each decode step then also
//! computes which rows' logits hold a NaN, on the device with the step (no extra wait), and
//! when one does, reports the step's rows and which caches hold NaNs, to find where it began.

use std::sync::OnceLock;

use mlx_rs::Array;

use crate::{cache::KvCache, error::Result};

use super::batch::DecodeRow;

pub(super) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("RMLX_CHECK_FINITE").is_ok_and(|v| v == "1"))
}

/// `[B]` bools: whether row b of `logits` (`[B, vocab]`) holds a NaN.
pub(super) fn nan_rows(logits: &Array) -> Result<Array> {
    Ok(logits.is_nan()?.any_axes(&[-1], false)?)
}

thread_local! {
    /// The last step's flags: checked a step later, once its tokens were read, so the check
    /// adds no wait (a race that a wait would hide stays visible).
    static PENDING: std::cell::RefCell<Option<Array>> = const { std::cell::RefCell::new(None) };
}

/// Checks the step before this one, then keeps this one's `flags` for the next.
pub(super) fn check_previous<R: DecodeRow>(
    flags: Option<Array>,
    caches: &[KvCache],
    rows: &mut [R],
) -> Result<()> {
    let previous = PENDING.with(|pending| std::mem::replace(&mut *pending.borrow_mut(), flags));
    match previous {
        Some(previous) if previous.shape()[0] as usize == rows.len() => {
            report(&previous, caches, rows)
        }
        _ => Ok(()),
    }
}

/// Reports rows whose logits held a NaN.
fn report<R: DecodeRow>(flags: &Array, caches: &[KvCache], rows: &mut [R]) -> Result<()> {
    crate::runtime::eval([flags])?;
    let bad: Vec<usize> = flags
        .as_slice::<bool>()
        .iter()
        .enumerate()
        .filter_map(|(b, &nan)| nan.then_some(b))
        .collect();
    if bad.is_empty() {
        return Ok(());
    }
    let lengths: Vec<usize> = rows
        .iter_mut()
        .map(|row| row.sequence().history.len())
        .collect();
    let first = caches.first();
    eprintln!(
        "rmlx: NaN logits in a decode step of {} rows: rows {bad:?}; histories {lengths:?}; \
         cache 0 offset {:?} base {:?} row ends {:?} padded {:?} ragged {:?}",
        rows.len(),
        first.map(KvCache::offset),
        first.map(KvCache::base),
        first.map(KvCache::row_offsets),
        first.map(KvCache::is_padded),
        first.map(KvCache::is_ragged),
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
