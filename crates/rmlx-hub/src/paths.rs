//! Names that become paths: repository ids (`org/name`) and the hub's file names. Everything the
//! hub sends is untrusted, so each name is checked lexically before any byte is written, and
//! every folder on the way is checked again on disk so a symlink cannot lead the write outside
//! the model folder. References: huggingface_hub `utils/_validators.py` (`validate_repo_id`) and
//! `file_download.py` (which refuses `rfilename`s that resolve outside the snapshot folder);
//! the same checks as `rmlx-server`'s registry (`check_id`, `stays_inside`).

use std::{
    fmt,
    path::{Component, Path, PathBuf},
    str::FromStr,
};

use crate::error::{HubError, Result};

/// Suffix of a file being downloaded; it is renamed away only after its hash checks out.
pub const PARTIAL_SUFFIX: &str = ".partial";

/// The models folder shared by `rmlx pull`, `rmlx serve` and the app when none is configured:
/// `$RMLX_MODELS_DIR`, else `~/.rmlx/models`; None without a home folder.
pub fn default_models_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("RMLX_MODELS_DIR").filter(|dir| !dir.is_empty()) {
        return Some(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME").filter(|home| !home.is_empty())?;
    Some(PathBuf::from(home).join(".rmlx/models"))
}

/// A validated `org/name` repository id; also the model's id once downloaded.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RepoId {
    org: String,
    name: String,
}

impl RepoId {
    pub fn parse(id: &str) -> Result<Self> {
        let invalid = |reason| HubError::InvalidRepoId {
            id: id.to_string(),
            reason,
        };
        let (org, name) = id.split_once('/').ok_or_else(|| invalid("no `/`"))?;
        for part in [org, name] {
            if part.is_empty() {
                return Err(invalid("empty part"));
            }
            if part == "." || part == ".." {
                return Err(invalid("`.` and `..` are not names"));
            }
            if !part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
            {
                return Err(invalid(
                    "only letters, digits, `.`, `_` and `-` are allowed",
                ));
            }
        }
        Ok(Self {
            org: org.to_string(),
            name: name.to_string(),
        })
    }

    pub fn org(&self) -> &str {
        &self.org
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `{models_dir}/{org}/{name}`: the layout `rmlx serve --models-dir` lists as `org/name`.
    pub fn model_dir(&self, models_dir: &Path) -> PathBuf {
        models_dir.join(&self.org).join(&self.name)
    }
}

impl fmt::Display for RepoId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.org, self.name)
    }
}

impl FromStr for RepoId {
    type Err = HubError;
    fn from_str(id: &str) -> Result<Self> {
        Self::parse(id)
    }
}

/// A branch, tag or commit as git allows it (`git check-ref-format`): no `..`, control
/// characters, spaces or `~^:?*[\\`, no empty path parts. Revisions only travel inside URLs (as
/// one encoded path segment), so this refuses mistakes and tricks rather than guarding a path.
pub fn check_revision(revision: &str) -> Result<()> {
    let bad = revision.is_empty()
        || revision.chars().count() > 256
        || revision.contains("..")
        || revision.contains("@{")
        || revision.starts_with('/')
        || revision.ends_with('/')
        || revision.contains("//")
        || revision
            .chars()
            .any(|c| c.is_control() || c.is_whitespace() || "~^:?*[\\".contains(c));
    if bad {
        return Err(HubError::InvalidRevision(revision.to_string()));
    }
    Ok(())
}

/// A hub `rfilename` may only name a file strictly below the model folder: relative,
/// `/`-separated, no `.`/`..`/empty parts, no backslash (a separator on Windows), no NUL, and not
/// our own `.partial` suffix (it would collide with another file's download).
pub fn check_file_name(name: &str) -> Result<()> {
    let unsafe_name = |reason| HubError::UnsafeFileName {
        name: name.to_string(),
        reason,
    };
    if name.is_empty() {
        return Err(unsafe_name("empty"));
    }
    if name.contains('\0') {
        return Err(unsafe_name("contains NUL"));
    }
    if name.contains('\\') {
        return Err(unsafe_name("contains a backslash"));
    }
    if name.starts_with('/') || Path::new(name).is_absolute() {
        return Err(unsafe_name("absolute path"));
    }
    if name.split('/').any(|part| part == "..") {
        return Err(unsafe_name("contains `..`"));
    }
    if name.split('/').any(|part| part.is_empty() || part == ".") {
        return Err(unsafe_name("empty or `.` path part"));
    }
    // Catches what the checks above cannot see on another OS (drive prefixes on Windows).
    if !Path::new(name)
        .components()
        .all(|part| matches!(part, Component::Normal(_)))
    {
        return Err(unsafe_name("not a plain relative path"));
    }
    if name.ends_with(PARTIAL_SUFFIX) {
        return Err(unsafe_name(
            "ends in .partial, the suffix of unfinished downloads",
        ));
    }
    Ok(())
}

/// Creates `root/relative` one folder at a time, checking after each step that the folder (which
/// may already exist as a symlink) still resolves inside `root`. Checking before descending
/// means nothing is ever created beneath a folder outside `root`. Returns the folder's path.
/// `root` must already exist.
pub(crate) fn create_dir_inside(root: &Path, relative: &Path) -> Result<PathBuf> {
    let canonical_root = root
        .canonicalize()
        .map_err(|error| HubError::io(root, error))?;
    let mut path = root.to_path_buf();
    for part in relative.components() {
        let Component::Normal(part) = part else {
            return Err(HubError::PathEscape {
                path: root.join(relative),
                root: root.to_path_buf(),
            });
        };
        path.push(part);
        match std::fs::create_dir(&path) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(error) => return Err(HubError::io(&path, error)),
        }
        ensure_inside(&canonical_root, &path, root)?;
    }
    Ok(path)
}

/// `path` (which must exist) resolves to somewhere under the canonical `root`.
pub(crate) fn ensure_inside(canonical_root: &Path, path: &Path, root: &Path) -> Result<()> {
    let resolved = path
        .canonicalize()
        .map_err(|error| HubError::io(path, error))?;
    if !resolved.starts_with(canonical_root) || !resolved.is_dir() {
        return Err(HubError::PathEscape {
            path: path.to_path_buf(),
            root: root.to_path_buf(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids() {
        let id = RepoId::parse("Qwen/Qwen3-0.6B").unwrap();
        assert_eq!((id.org(), id.name()), ("Qwen", "Qwen3-0.6B"));
        assert_eq!(id.to_string(), "Qwen/Qwen3-0.6B");
        assert_eq!(
            id.model_dir(Path::new("/m")),
            PathBuf::from("/m/Qwen/Qwen3-0.6B")
        );
        for bad in [
            "", "qwen", "a/b/c", "../x", "a/..", "./b", "a/.", "/a", "a/", "a b/c", "a/b\\c",
            "a/b\0", "a/ü", "a/b:c",
        ] {
            assert!(
                matches!(RepoId::parse(bad), Err(HubError::InvalidRepoId { .. })),
                "{bad:?} should be refused"
            );
        }
    }

    #[test]
    fn file_names() {
        for good in [
            "config.json",
            "sub/dir/model.safetensors",
            "a..b",
            ".gitattributes",
        ] {
            check_file_name(good).unwrap();
        }
        for bad in [
            "",
            "../evil",
            "a/../../evil",
            "..",
            "/abs",
            "a\\b",
            "a\0b",
            "a//b",
            "./a",
            "a/./b",
            "dir/",
            "x.partial",
        ] {
            assert!(
                matches!(check_file_name(bad), Err(HubError::UnsafeFileName { .. })),
                "{bad:?} should be refused"
            );
        }
    }

    #[cfg(unix)]
    #[test]
    fn folders_that_symlink_outside_are_refused_before_creating_below_them() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("org")).unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join("org/link")).unwrap();
        let made = create_dir_inside(root.path(), Path::new("org/name/sub")).unwrap();
        assert!(made.is_dir());
        let refused = create_dir_inside(root.path(), Path::new("org/link/sub"));
        assert!(matches!(refused, Err(HubError::PathEscape { .. })));
        assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
    }
}
