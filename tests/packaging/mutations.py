"""Shows the repository checks of test_packaging.py can fail: each mutation below breaks one
promise in a copy of the files they read, and the test for it must then fail (and pass on the
unbroken copy). Run by tests/packaging/run.sh after the tests themselves."""

import os
import re
import shutil
import subprocess
import sys
import tempfile

from test_packaging import toml_loads

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "../.."))
FORMULA = "packaging/homebrew/rmlx.rb"
CASK = "packaging/homebrew/rmlx-app.rb"

# (what is broken, file, pattern, replacement, the test that must notice)
MUTATIONS = [
    ("formula syntax", FORMULA, r"^end\n\Z", "end\nend\n", "RubySyntax"),
    ("cask syntax", CASK, r'  app "rMLX\.app"', '  app "rMLX.app" do', "RubySyntax"),
    ("formula gains a bottle block", FORMULA, r'(  head .*\n)',
     '\\1\n  bottle do\n    sha256 cellar: :any, arm64_sonoma: "' + "1" * 64 + '"\n  end\n', "Formula.test_no_bottle_block"),
    ("cask version", CASK, r'version "[^"]+"', 'version "0.0.9"', "Versions.test_versions_agree"),
    ("formula version", FORMULA, r"/rmlx-[^/\"]+\.tar\.gz", "/rmlx-0.0.9.tar.gz", "Versions.test_versions_agree"),
    ("workspace version", "Cargo.toml", r'(\[workspace\.package\]\nversion = )"[^"]+"', '\\1"0.0.9"', "Versions.test_versions_agree"),
    ("tauri.conf.json version", "src-tauri/tauri.conf.json", r'"version": "[^"]+"', '"version": "0.0.9"', "Versions.test_versions_agree"),
    ("Cargo.lock entry", "Cargo.lock", r'(name = "rmlx-cli"\nversion = )"[^"]+"', '\\1"0.0.9"', "Versions.test_versions_agree"),
    ("mlx-c sha256", FORMULA, r'sha256 "da965f', 'sha256 "aa965f', "Formula.test_resources_are_the_pins"),
    ("MLX version pinned", "mlx.pins", r"MLX_VERSION=[\d.]+", "MLX_VERSION=0.33.0", "Formula.test_resources_are_the_pins"),
    ("mlx-metal wheel sha256", "mlx.pins", r"MLX_METAL_MACOS_ARM64_SHA256=3", "MLX_METAL_MACOS_ARM64_SHA256=4",
     "Formula.test_resources_are_the_pins"),
    ("bundle minimum", "src-tauri/tauri.macos.conf.json", r'"minimumSystemVersion": "14\.0"',
     '"minimumSystemVersion": "15.0"', "Cask.test_cask"),
    ("cask auto_updates", CASK, r"^  auto_updates true$", "  auto_updates false", "Cask.test_cask"),
]


def copy_tree(tmp):
    files = ["Cargo.toml", "Cargo.lock", "mlx.pins", "src-tauri/tauri.conf.json", "src-tauri/tauri.macos.conf.json", FORMULA, CASK]
    with open(os.path.join(REPO, "Cargo.toml"), encoding="utf-8") as file:
        files += [f"{member}/Cargo.toml" for member in toml_loads(file.read())["workspace"]["members"]]
    for relative in files:
        os.makedirs(os.path.dirname(os.path.join(tmp, relative)), exist_ok=True)
        shutil.copy(os.path.join(REPO, relative), os.path.join(tmp, relative))


def run_test(root, test):
    env = dict(os.environ, RMLX_PACKAGING_ROOT=root)
    out = subprocess.run([sys.executable, "-m", "unittest", f"test_packaging.{test}"], cwd=HERE, env=env,
                         capture_output=True, text=True, check=False)
    return out.returncode == 0


def main():
    failures = []
    for what, relative, pattern, replacement, test in MUTATIONS:
        with tempfile.TemporaryDirectory() as tmp:
            copy_tree(tmp)
            if not run_test(tmp, test):
                failures.append(f"{test} fails on the unbroken copy (before: {what})")
                continue
            path = os.path.join(tmp, relative)
            with open(path, encoding="utf-8") as file:
                text = file.read()
            broken, count = re.subn(pattern, replacement, text, count=1, flags=re.MULTILINE)
            if count != 1:
                failures.append(f"mutation {what!r}: {pattern!r} not found in {relative}")
                continue
            with open(path, "w", encoding="utf-8") as file:
                file.write(broken)
            if run_test(tmp, test):
                failures.append(f"{test} still passes with {what} broken")
    if failures:
        print("packaging mutations: the checks did not catch:\n  " + "\n  ".join(failures), file=sys.stderr)
        sys.exit(1)
    print(f"packaging mutations: each of {len(MUTATIONS)} breakages failed its test")


if __name__ == "__main__":
    main()
