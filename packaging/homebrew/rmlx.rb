# The `rmlx` command line tool (Homebrew tap formula), built from the release's source tarball.
# docs/RELEASING.md says how a release fills in `url` / `sha256` and the `bottle do` block.
#
# MLX: exactly the pair mlx.pins names (MLX 0.32.2 + mlx-c 0.7.0), not Homebrew's own `mlx` /
#   `mlx-c`, which follow their own releases. The two resources below are that pair with the
#   sha256 sums of mlx.pins: the mlx-metal wheel (libmlx.dylib, mlx.metallib, headers and CMake
#   config; the MLX_METAL_MACOS_ARM64 wheel) and the mlx-c source inside the crates.io crate
#   mlx-sys 0.7.0. mlx-c is built against the wheel as scripts/bootstrap-mlx builds it
#   (install RPATH @loader_path, so libmlxc finds libmlx beside it). `make test` checks that
#   the resources' versions and sha256 sums equal mlx.pins (tests/packaging/).
#
# Layout: libexec/bin/rmlx and libexec/lib/{libmlx.dylib, mlx.metallib, libmlxc.dylib};
#   bin/rmlx is a symlink. rmlx opens libmlxc at run time from ../lib of its own resolved
#   (symlink-free) path (crates/mlx-sys/src/loader.rs), and libmlx finds mlx.metallib beside
#   itself, so no absolute Cellar path is baked in and `brew upgrade` moves everything together.
#
# UI: built during the install (`depends_on "node" => :build`, `npm ci` from ui/package-lock.json,
#   then `npm run build`), because `rmlx serve` embeds ui/dist at compile time and the source
#   tarball carries the UI's sources, not its build. An install whose UI build produced no
#   ui/dist/index.html stops with a message instead of shipping an `rmlx serve` without its chat.
#
# Bottles: this committed formula has no `bottle do` block (make test checks it); it builds from
#   source until a release uploads a bottle (scripts/release/build_bottle.sh prints the block).
class Rmlx < Formula
  desc "Local AI on Apple Silicon: MLX inference with an OpenAI and Anthropic compatible server"
  homepage "https://github.com/rmlx/rmlx"
  url "https://github.com/rmlx/rmlx/releases/download/v0.1.0/rmlx-0.1.0.tar.gz"
  sha256 "0000000000000000000000000000000000000000000000000000000000000000"
  license any_of: ["MIT", "Apache-2.0"]
  head "https://github.com/rmlx/rmlx.git", branch: "main"

  depends_on "cmake" => :build
  depends_on "node" => :build
  depends_on "rust" => :build
  depends_on arch: :arm64
  # The mlx-metal wheel is built for macOS 14 (its tag: macosx_14_0_arm64).
  depends_on macos: :sonoma

  resource "mlx-metal" do
    url "https://files.pythonhosted.org/packages/f7/ab/ba1952908c5d2a5070cf1cfbfea0161c4751ea62299e2776819810917483/mlx_metal-0.32.2-py3-none-macosx_14_0_arm64.whl", using: :nounzip
    version "0.32.2"
    sha256 "3825fff379dbc107dd3413e564a06caeaa24819910ec49c0439e454c06a1b9b8"
  end

  resource "mlx-c" do
    url "https://static.crates.io/crates/mlx-sys/mlx-sys-0.7.0.crate"
    version "0.7.0"
    sha256 "da965f83ce211b80f9b681d9bbd6fa625fe6bb2e659ba7bc55dd95eea8d3b028"
  end

  def install
    # The pinned pair, laid out as scripts/bootstrap-mlx lays out .mlx/<variant>/: mlx/{lib,include}
    # and a `versions` file that crates/mlx-sys/build.rs compares with mlx.pins.
    pinned = buildpath/"mlx-pinned"
    mlx = pinned/"mlx"
    resource("mlx-metal").stage do
      system "unzip", "-q", Dir["*.whl"].fetch(0), "mlx/*", "-d", pinned
    end
    # The wheel's CMake targets name the frameworks by the SDK path of the machine that built it.
    inreplace mlx/"share/cmake/MLX/MLXTargets.cmake", %r{/Applications/[^;"]+?/MacOSX\.sdk}, MacOS.sdk_path.to_s

    resource("mlx-c").stage do
      system "cmake", "-S", "src/mlx-c", "-B", "build",
             "-DMLX_C_USE_SYSTEM_MLX=ON", "-DMLX_DIR=#{mlx}/share/cmake/MLX",
             "-DBUILD_SHARED_LIBS=ON", "-DMLX_C_BUILD_EXAMPLES=OFF",
             "-DCMAKE_INSTALL_RPATH=@loader_path", "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
             *std_cmake_args(install_prefix: mlx)
      system "cmake", "--build", "build"
      system "cmake", "--install", "build"
    end
    (pinned/"versions").write <<~EOS
      MLX_VERSION=#{resource("mlx-metal").version}
      MLX_C_VERSION=#{resource("mlx-c").version}
      VARIANT=metal
    EOS

    # The UI first: crates/rmlx-server/build.rs embeds ui/dist into the binary.
    cd "ui" do
      system "npm", "ci", "--no-audit", "--no-fund", "--cache=#{HOMEBREW_CACHE}/npm_cache"
      system "npm", "run", "build"
    end
    odie "the UI build made no ui/dist/index.html: rmlx serve would have no chat" unless (buildpath/"ui/dist/index.html").exist?

    ENV["MLX_PREFIX"] = mlx.to_s
    system "cargo", "build", "--release", "--locked", "--bin", "rmlx"

    (libexec/"bin").install "target/release/rmlx"
    (libexec/"lib").install mlx/"lib/libmlx.dylib", mlx/"lib/mlx.metallib", mlx/"lib/libmlxc.dylib"
    bin.install_symlink libexec/"bin/rmlx"
  end

  test do
    assert_match version.to_s, shell_output("#{bin}/rmlx --version")
    # Evaluates a matmul, a softmax and a 4-bit quantized matmul on the default device.
    output = shell_output("#{bin}/rmlx doctor")
    assert_match "MLX 0.32.2 (pinned 0.32.2) from", output
    assert_match "/libexec/", output # the keg's own libraries, not another MLX on the system
    assert_match "metal: true", output
  end
end
