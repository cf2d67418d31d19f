//! Stored responses for `previous_response_id`: each id keeps the conversation as input items
//! (the input it was given, its own previous chain included, then its output), in memory,
//! bounded in bytes with the least recently used dropped first. Codex sends `store: false` and
//! the whole history every turn, so this serves the SDKs' stateful use, not the agents.

use std::{collections::HashMap, sync::Mutex};

use serde_json::Value;

/// Bytes of serialized items kept at most (a conversation with images is mostly base64).
pub const DEFAULT_BUDGET: usize = 64 * 1024 * 1024;

pub struct Store {
    budget: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    bytes: usize,
    /// Bumped on every use: the entry with the smallest stamp goes first.
    clock: u64,
}

struct Entry {
    /// The items as JSON text: its length is what the budget counts.
    items: String,
    used: u64,
}

impl Default for Store {
    fn default() -> Self {
        Self::with_budget(DEFAULT_BUDGET)
    }
}

impl Store {
    pub fn with_budget(budget: usize) -> Self {
        Self {
            budget,
            inner: Mutex::default(),
        }
    }

    /// Keeps `items` under `id`, evicting the least recently used until they fit; a
    /// conversation larger than the whole budget is not kept (a later lookup says so).
    pub fn put(&self, id: &str, items: &[Value]) {
        let text = Value::Array(items.to_vec()).to_string();
        if text.len() > self.budget {
            crate::parse::log_warnings(vec![format!(
                "response {id} is not stored: its conversation ({} bytes) is larger than the \
                 store ({} bytes)",
                text.len(),
                self.budget
            )]);
            return;
        }
        let mut inner = self
            .inner
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        while inner.bytes + text.len() > self.budget {
            let Some(oldest) = inner
                .entries
                .iter()
                .min_by_key(|(_, entry)| entry.used)
                .map(|(id, _)| id.clone())
            else {
                break;
            };
            if let Some(entry) = inner.entries.remove(&oldest) {
                inner.bytes -= entry.items.len();
            }
        }
        inner.clock += 1;
        let used = inner.clock;
        inner.bytes += text.len();
        if let Some(old) = inner
            .entries
            .insert(id.to_string(), Entry { items: text, used })
        {
            inner.bytes -= old.items.len();
        }
    }

    /// The items stored under `id` (and marks it used), or None.
    pub fn get(&self, id: &str) -> Option<Vec<Value>> {
        let mut inner = self
            .inner
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        inner.clock += 1;
        let clock = inner.clock;
        let entry = inner.entries.get_mut(id)?;
        entry.used = clock;
        serde_json::from_str(&entry.items).ok()
    }

    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .bytes
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn least_recently_used_goes_first_and_the_budget_holds() {
        let item = |text: &str| vec![json!({"role": "user", "content": text})];
        let size = Value::Array(item("aaaa")).to_string().len();
        let store = Store::with_budget(size * 2);
        store.put("a", &item("aaaa"));
        store.put("b", &item("bbbb"));
        assert!(
            store.get("a").is_some(),
            "a is used, so b is now the oldest"
        );
        store.put("c", &item("cccc"));
        assert!(store.get("b").is_none());
        assert_eq!(store.get("a").unwrap(), item("aaaa"));
        assert_eq!(store.get("c").unwrap(), item("cccc"));
        assert_eq!(store.bytes(), size * 2);
        // Too large for the whole store: not kept, nothing evicted for it.
        store.put("huge", &item(&"x".repeat(size * 3)));
        assert!(store.get("huge").is_none());
        assert!(store.get("a").is_some() && store.get("c").is_some());
        // The same id again replaces its entry.
        store.put("a", &item("AAAA"));
        assert_eq!(store.get("a").unwrap(), item("AAAA"));
        assert_eq!(store.bytes(), size * 2);
    }
}
