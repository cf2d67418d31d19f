"""The Homebrew packaging's promises, checked without Homebrew (run by tests/packaging/run.sh).

- the formula and the cask are valid Ruby (`ruby -c`) and read as Homebrew DSL (dsl_dump.rb);
- the committed formula has no `bottle do` block (it builds from source until a bottle is up);
- rMLX's version agrees across the formula, the cask, Cargo.toml's [workspace.package], the
  Cargo.lock entries that inherit it, and src-tauri/tauri.conf.json;
- the formula's MLX and mlx-c resources are mlx.pins' (version, sha256, url);
- the cask's macOS minimum is the bundle's, and it says the app updates itself;
- scripts/release/bottle-json renames and renders the `bottle do` block from real
  `brew bottle --json` output (tests/packaging/data, copied from ../shared/packaging);
- scripts/release/build_bottle.sh drives brew in order (against tests/packaging/fake-brew);
- scripts/release/bump-version moves every version together.

RMLX_PACKAGING_ROOT points the repository checks at another tree (how run.sh shows they fail).
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import unittest

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11 (macOS's own python3): the subset read here.
    tomllib = None

def toml_loads(text):
    """TOML: tomllib where there is one, else the subset Cargo.toml / Cargo.lock use here
    (tables, arrays of tables, dotted keys, strings, booleans, string arrays)."""
    if tomllib:
        return tomllib.loads(text)
    data = {}
    table, pending = data, None
    for raw in text.splitlines():
        line = raw.split(" #")[0].strip()
        if pending is not None:
            pending[1].extend(re.findall(r'"([^"]*)"', line))
            if line.startswith("]"):
                pending = None
            continue
        if not line or line.startswith("#"):
            continue
        if line.startswith("[["):
            table = {}
            data.setdefault(line.strip("[]"), []).append(table)
        elif line.startswith("["):
            table = data
            for part in line.strip("[]").split("."):
                table = table.setdefault(part, {})
        elif "=" in line:
            key, value = (part.strip() for part in line.split("=", 1))
            *parents, last = key.split(".")
            target = table
            for parent in parents:
                target = target.setdefault(parent, {})
            if value.startswith("[") and not value.endswith("]"):
                target[last] = re.findall(r'"([^"]*)"', value)
                pending = (last, target[last])
            elif value.startswith("["):
                target[last] = re.findall(r'"([^"]*)"', value)
            elif value in ("true", "false"):
                target[last] = value == "true"
            else:
                target[last] = value.strip('"')
    return data


HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "../.."))
ROOT = os.path.abspath(os.environ.get("RMLX_PACKAGING_ROOT", REPO))
FORMULA = "packaging/homebrew/rmlx.rb"
CASK = "packaging/homebrew/rmlx-app.rb"
SAMPLE = os.path.join(HERE, "data/brew-bottle-sample.x86_64_linux.json")
BOTTLE_JSON = os.path.join(REPO, "scripts/release/bottle-json")
# macOS major version -> the symbol Homebrew names it by.
MACOS_NAMES = {"13": "ventura", "14": "sonoma", "15": "sequoia", "26": "tahoe"}


def read(relative, root=ROOT):
    with open(os.path.join(root, relative), encoding="utf-8") as file:
        return file.read()


def write(path, data):
    with open(path, "wb" if isinstance(data, bytes) else "w", encoding=None if isinstance(data, bytes) else "utf-8") as file:
        file.write(data)


def load_json(path):
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def dsl(relative, root=ROOT):
    """The DSL calls of a formula or cask, as dsl_dump.rb records them."""
    out = subprocess.run(["ruby", os.path.join(HERE, "dsl_dump.rb"), os.path.join(root, relative)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise AssertionError(f"dsl_dump.rb {relative} failed:\n{out.stderr}")
    return json.loads(out.stdout)


def calls(tree, name):
    return [call for call in tree["calls"] if call["name"] == name]


def single(tree, name):
    found = calls(tree, name)
    if len(found) != 1:
        raise AssertionError(f"expected one `{name}` in {tree.get('class') or tree.get('token')}, found {len(found)}")
    return found[0]["args"]


def resource(tree, resource_name):
    blocks = [call["block"] for call in calls(tree, "resource") if call["args"] == [resource_name]]
    if len(blocks) != 1:
        raise AssertionError(f"expected one resource {resource_name!r}, found {len(blocks)}")
    return {"calls": blocks[0]}


def pins(root=ROOT):
    values = {}
    for line in read("mlx.pins", root).splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip()
    return values


def versions(root=ROOT):
    """Every place rMLX's version is written, by name."""
    found = {}
    url = single(dsl(FORMULA, root), "url")[0]
    match = re.fullmatch(r"https://github\.com/rmlx/rmlx/releases/download/v([^/]+)/rmlx-([^/]+)\.tar\.gz", url)
    if not match:
        raise AssertionError(f"formula url {url} is not .../download/vVERSION/rmlx-VERSION.tar.gz")
    found["formula url tag"], found["formula url tarball"] = match.groups()
    cask = dsl(CASK, root)
    found["cask version"] = single(cask, "version")[0]
    cask_url = single(cask, "url")[0]
    if f"/v{found['cask version']}/" not in cask_url:
        raise AssertionError(f"cask url {cask_url} does not name v{found['cask version']}")
    manifest = toml_loads(read("Cargo.toml", root))
    found["Cargo.toml [workspace.package]"] = manifest["workspace"]["package"]["version"]
    found["src-tauri/tauri.conf.json"] = json.loads(read("src-tauri/tauri.conf.json", root))["version"]
    lock = {package["name"]: package for package in toml_loads(read("Cargo.lock", root))["package"]}
    for member in manifest["workspace"]["members"]:
        package = toml_loads(read(f"{member}/Cargo.toml", root))["package"]
        if package.get("version") == {"workspace": True}:
            found[f"Cargo.lock {package['name']}"] = lock[package["name"]]["version"]
    return found


class RubySyntax(unittest.TestCase):
    def test_formula_and_cask_parse(self):
        for relative in (FORMULA, CASK):
            out = subprocess.run(["ruby", "-c", os.path.join(ROOT, relative)], capture_output=True, text=True, check=False)
            self.assertEqual(out.returncode, 0, f"ruby -c {relative}:\n{out.stderr}")
            self.assertIn("Syntax OK", out.stdout)


class Formula(unittest.TestCase):
    def test_no_bottle_block(self):
        self.assertEqual(calls(dsl(FORMULA), "bottle"), [], f"{FORMULA} has a `bottle do` block")
        code = [line for line in read(FORMULA).splitlines() if not line.lstrip().startswith("#")]
        self.assertFalse([line for line in code if re.match(r"\s*bottle\s+do\b", line)], f"{FORMULA} has a `bottle do` line")

    def test_resources_are_the_pins(self):
        formula, pinned = dsl(FORMULA), pins()
        mlx = resource(formula, "mlx-metal")
        self.assertEqual(single(mlx, "version"), [pinned["MLX_VERSION"]], "mlx-metal version")
        self.assertEqual(single(mlx, "sha256"), [pinned["MLX_METAL_MACOS_ARM64_SHA256"]], "mlx-metal sha256")
        url = single(mlx, "url")[0]
        self.assertTrue(url.startswith("https://files.pythonhosted.org/packages/"), url)
        self.assertRegex(os.path.basename(url), rf"^mlx_metal-{re.escape(pinned['MLX_VERSION'])}-py3-none-macosx_\d+_\d+_arm64\.whl$")
        mlx_c = resource(formula, "mlx-c")
        self.assertEqual(single(mlx_c, "version"), [pinned["MLX_C_VERSION"]], "mlx-c version")
        self.assertEqual(single(mlx_c, "sha256"), [pinned["MLX_C_CRATE_SHA256"]], "mlx-c sha256")
        self.assertEqual(single(mlx_c, "url"), [pinned["MLX_C_CRATE_URL"]], "mlx-c url")
        self.assertTrue(pinned["MLX_C_CRATE_URL"].endswith(f"-{pinned['MLX_C_VERSION']}.crate"))

    def test_build_and_test_shape(self):
        formula = dsl(FORMULA)
        depends = [call["args"][0] for call in calls(formula, "depends_on")]
        for build_dep in ("rust", "node", "cmake"):
            self.assertIn({build_dep: "build"}, depends)
        self.assertEqual(len(calls(formula, "test")), 1, "a `test do` block")
        text = read(FORMULA)
        self.assertIn('shell_output("#{bin}/rmlx doctor")', text)
        self.assertRegex(text, r'\(libexec/"lib"\)\.install .*libmlx\.dylib.*mlx\.metallib.*libmlxc\.dylib')
        self.assertIn('bin.install_symlink libexec/"bin/rmlx"', text)


class Cask(unittest.TestCase):
    def test_cask(self):
        cask = dsl(CASK)
        self.assertEqual(cask["token"], "rmlx-app", "a cask named rmlx would collide with the formula")
        self.assertEqual(single(cask, "auto_updates"), [True])
        self.assertEqual(single(cask, "app"), ["rMLX.app"])
        minimum = json.loads(read("src-tauri/tauri.macos.conf.json"))["bundle"]["macOS"]["minimumSystemVersion"]
        want = f">= :{MACOS_NAMES[minimum.split('.')[0]]}"
        macos = [call["args"][0]["macos"] for call in calls(cask, "depends_on") if "macos" in call["args"][0]]
        self.assertEqual(macos, [want], f"the bundle's minimum is macOS {minimum}")
        self.assertEqual(len(calls(cask, "zap")), 1)


class Versions(unittest.TestCase):
    def test_versions_agree(self):
        found = versions()
        self.assertEqual(len(set(found.values())), 1, "rMLX's version differs:\n" +
                         "\n".join(f"  {place}: {value}" for place, value in found.items()))

    def test_bump_moves_every_version(self):
        with tempfile.TemporaryDirectory() as tmp:
            files = ["Cargo.toml", "Cargo.lock", "mlx.pins", "src-tauri/tauri.conf.json", FORMULA, CASK]
            manifest = toml_loads(read("Cargo.toml"))
            files += [f"{member}/Cargo.toml" for member in manifest["workspace"]["members"]]
            for relative in files:
                os.makedirs(os.path.dirname(os.path.join(tmp, relative)), exist_ok=True)
                shutil.copy(os.path.join(ROOT, relative), os.path.join(tmp, relative))
            bump = os.path.join(REPO, "scripts/release/bump-version")
            subprocess.run([bump, "--root", tmp, "9.8.7"], check=True, capture_output=True)
            self.assertEqual(set(versions(tmp).values()), {"9.8.7"})
            sha = "c" * 64
            subprocess.run([bump, "--root", tmp, "--formula-sha256", sha], check=True, capture_output=True)
            self.assertEqual(single(dsl(FORMULA, tmp), "sha256"), [sha])
            self.assertEqual(single(resource(dsl(FORMULA, tmp), "mlx-c"), "sha256"), [pins()["MLX_C_CRATE_SHA256"]])
            bad = subprocess.run([bump, "--root", tmp, "--cask-sha256", "xyz"], capture_output=True, text=True)
            self.assertEqual(bad.returncode, 2, bad.stderr)


    @unittest.skipUnless(tomllib, "no tomllib to compare with")
    def test_toml_subset_reader(self):
        # What macOS's older python3 uses instead of tomllib reads these files the same way.
        global tomllib
        real, tomllib = tomllib, None
        try:
            subset = versions()
        finally:
            tomllib = real
        self.assertEqual(subset, versions())


class BottleJson(unittest.TestCase):
    def run_tool(self, *args):
        return subprocess.run([BOTTLE_JSON, *args], capture_output=True, text=True, check=False)

    def test_block_from_real_output(self):
        out = self.run_tool("block", SAMPLE)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout, "\n".join([
            "  bottle do",
            '    root_url "file:///tmp/bottles/release"',
            '    sha256 cellar: :any_skip_relocation, x86_64_linux: "268ae64b4d6ae909cf4189090d44b0580cf0ebe1539fe8e638e8d84a1f6b2537"',
            "  end",
        ]) + "\n")

    def test_rename_from_real_output(self):
        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, "toyc--0.1.0.x86_64_linux.bottle.tar.gz")
            asset = os.path.join(tmp, "toyc-0.1.0.x86_64_linux.bottle.tar.gz")
            write(local, b"bottle")
            out = self.run_tool("rename", "--dir", tmp, SAMPLE)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertEqual(out.stdout.split(), [asset])
            self.assertEqual(sorted(os.listdir(tmp)), [os.path.basename(asset)])
            with open(asset, "rb") as file:
                self.assertEqual(file.read(), b"bottle")
            self.assertEqual(self.run_tool("rename", "--dir", tmp, SAMPLE).returncode, 0, "a second rename is a no-op")
            os.remove(asset)
            missing = self.run_tool("rename", "--dir", tmp, SAMPLE)
            self.assertEqual(missing.returncode, 2)
            self.assertIn("neither", missing.stderr)

    def test_merged_tags_and_cellars(self):
        sample = load_json(SAMPLE)
        (key, entry), = sample.items()
        (_, tag_info), = entry["bottle"]["tags"].items()
        with tempfile.TemporaryDirectory() as tmp:
            paths = []
            for tag, cellar, sha in (("arm64_sequoia", "any", "1" * 64), ("arm64_sonoma", "/opt/homebrew/Cellar", "2" * 64),
                                     ("sonoma", "/opt/custom/Cellar", "3" * 64)):
                variant = json.loads(json.dumps(entry))
                variant["bottle"].update(cellar=cellar, rebuild=1, tags={tag: dict(tag_info, sha256=sha)})
                paths.append(os.path.join(tmp, f"{tag}.json"))
                write(paths[-1], json.dumps({key: variant}))
            out = self.run_tool("block", *paths)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertEqual(out.stdout.splitlines()[2:-1], [
                "    rebuild 1",
                f'    sha256 cellar: :any, arm64_sequoia: "{"1" * 64}"',
                f'    sha256 arm64_sonoma: "{"2" * 64}"',
                f'    sha256 cellar: "/opt/custom/Cellar", sonoma: "{"3" * 64}"',
            ])

    def test_cellar_inside_a_tag_is_refused(self):
        # The shape a guess would give: cellar per tag. The real JSON has it beside `tags`.
        sample = load_json(SAMPLE)
        (key, entry), = sample.items()
        cellar = entry["bottle"].pop("cellar")
        for tag_info in entry["bottle"]["tags"].values():
            tag_info["cellar"] = cellar
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "guess.json")
            write(path, json.dumps({key: entry}))
            out = self.run_tool("block", path)
            self.assertEqual(out.returncode, 2)
            self.assertIn("cellar", out.stderr)


class BuildBottleScript(unittest.TestCase):
    def test_flow_against_fake_brew(self):
        with tempfile.TemporaryDirectory() as tmp:
            tarball = os.path.join(tmp, "rmlx-src.tar.gz")
            write(tarball, b"source")
            env = dict(os.environ, FAKE_BREW_HOME=tmp, OUT=os.path.join(tmp, "out"), WRITE="1",
                       SOURCE_TARBALL=tarball, PATH=os.path.join(HERE, "fake-brew") + os.pathsep + os.environ["PATH"])
            out = subprocess.run([os.path.join(REPO, "scripts/release/build_bottle.sh")], env=env,
                                 capture_output=True, text=True, check=False)
            self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
            version = versions(REPO)["formula url tarball"]
            log = read("log", tmp).splitlines()
            verbs = [line.split()[0] + (" --merge" if "--merge" in line else "") for line in log]
            self.assertEqual([v for v in verbs if v in ("install", "bottle", "bottle --merge")],
                             ["install", "bottle", "bottle --merge"])
            self.assertIn("install --build-bottle rmlx/tap/rmlx", log)
            root_url = f"https://github.com/rmlx/rmlx/releases/download/v{version}"
            self.assertIn(f"bottle --json --root-url={root_url} rmlx/tap/rmlx", log)
            asset = f"rmlx-{version}.arm64_sequoia.bottle.tar.gz"
            self.assertIn(asset, os.listdir(os.path.join(tmp, "out")))
            self.assertNotIn(f"rmlx--{version}.arm64_sequoia.bottle.tar.gz", os.listdir(os.path.join(tmp, "out")))
            self.assertIn(f'    root_url "{root_url}"\n    sha256 cellar: :any, arm64_sequoia: "{"ab" * 32}"\n  end', out.stdout)
            # The tap's copy builds from the local tarball; the resources are untouched.
            tapped = os.path.join(tmp, "Taps/rmlx/homebrew-tap/Formula/rmlx.rb")
            copy = dsl(os.path.basename(tapped), os.path.dirname(tapped))
            self.assertEqual(single(copy, "url"), [f"file://{tarball}"])
            self.assertEqual(single(copy, "version"), [version])
            with open(tarball, "rb") as file:
                self.assertEqual(single(copy, "sha256"), [hashlib.sha256(file.read()).hexdigest()])
            self.assertEqual(single(resource(copy, "mlx-c"), "sha256"), [pins(REPO)["MLX_C_CRATE_SHA256"]])
            # The committed formula is untouched.
            self.assertEqual(calls(dsl(FORMULA, REPO), "bottle"), [])


if __name__ == "__main__":
    unittest.main()
