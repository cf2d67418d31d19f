# rMLX.app (Homebrew tap cask): the signed, notarized disk image a release uploads
# (docs/RELEASING.md). Named rmlx-app because a cask named like the `rmlx` formula would collide
# on `brew install rmlx`. The app updates itself (tauri-plugin-updater, latest.json), hence
# `auto_updates true`: `brew upgrade` leaves it alone unless asked with --greedy.
cask "rmlx-app" do
  version "0.1.0"
  sha256 "0000000000000000000000000000000000000000000000000000000000000000"

  url "https://github.com/rmlx/rmlx/releases/download/v#{version}/rMLX_#{version}_aarch64.dmg"
  name "rMLX"
  desc "Menu-bar app for local AI on Apple Silicon, with an OpenAI compatible server"
  homepage "https://github.com/rmlx/rmlx"

  livecheck do
    url :url
    strategy :github_latest
  end

  auto_updates true
  depends_on arch: :arm64
  # bundle.macOS.minimumSystemVersion in src-tauri/tauri.macos.conf.json (14.0).
  depends_on macos: ">= :sonoma"

  app "rMLX.app"

  # Models (~/.rmlx/models) are left alone: the `rmlx` formula shares them.
  zap trash: [
    "~/Library/Application Support/app.rmlx.desktop",
    "~/Library/Caches/app.rmlx.desktop",
    "~/Library/HTTPStorages/app.rmlx.desktop",
    "~/Library/LaunchAgents/rMLX.plist",
    "~/Library/Logs/app.rmlx.desktop",
    "~/Library/Preferences/app.rmlx.desktop.plist",
    "~/Library/Saved Application State/app.rmlx.desktop.savedState",
    "~/Library/WebKit/app.rmlx.desktop",
  ]
end
