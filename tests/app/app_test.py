#!/usr/bin/python3
"""The real rMLX.app, headless (run by scripts/app-test under dbus-run-session + Xvfb).

1. The tray menu is read and clicked over D-Bus (appindicator's dbusmenu): "Local API server"
   makes the configured port answer, unchecking it stops it; the status line follows.
2. The switch survives a restart.
3. A busy port: the status line says so and the app keeps running.
4. The window, opened at launch, draws the UI, which lists the models over IPC: a screenshot lands
   in $ARTIFACTS (looked at by eye).

Needs Debian's python3-gi (Gio) and ImageMagick's `import`; stdlib otherwise.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from gi.repository import Gio, GLib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
APP = os.environ.get("RMLX_APP_BIN", os.path.join(ROOT, "target/debug/rmlx-app"))
ARTIFACTS = os.environ.get("ARTIFACTS", os.path.join(ROOT, "target/app-test-artifacts"))
MODEL = os.path.join(ROOT, "tests/fixtures/qwen3-tiny")
# TrayIconBuilder::with_id("main") exports its menu here (libayatana-appindicator naming).
MENU = "/org/ayatana/NotificationItem/tray_icon_tray_app_main/Menu"
BUS = Gio.bus_get_sync(Gio.BusType.SESSION)


def call(dest, path, iface, method, args, timeout=3000):
    return BUS.call_sync(dest, path, iface, method, args, None, Gio.DBusCallFlags.NONE, timeout, None).unpack()


def wait(what, check, timeout=60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class Tray:
    """The app's tray menu, found on the bus by the app's process id."""

    def __init__(self, pid):
        self.dest = wait("the tray menu on D-Bus", lambda: self._find(pid))

    @staticmethod
    def _find(pid):
        names = call("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "ListNames", None)[0]
        for name in names:
            if not name.startswith(":"):
                continue
            try:
                owner = call("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus",
                             "GetConnectionUnixProcessID", GLib.Variant("(s)", (name,)))[0]
                if owner != pid:
                    continue
                call(name, MENU, "com.canonical.dbusmenu", "GetLayout", GLib.Variant("(iias)", (0, -1, [])))
                return name
            except GLib.Error:
                continue
        return None

    def items(self):
        _, (_, _, children) = call(self.dest, MENU, "com.canonical.dbusmenu", "GetLayout",
                                   GLib.Variant("(iias)", (0, -1, [])))
        return [(item_id, props) for item_id, props, _ in children]

    def label(self, item_id):
        return dict(self.items())[item_id].get("label", "")

    def find(self, text):
        for item_id, props in self.items():
            if props.get("label", "").replace("_", "") == text:
                return item_id
        raise AssertionError(f"no tray item {text!r}: {self.items()}")

    def status(self):
        return self.items()[0][1].get("label", "")

    def checked(self, text):
        return dict(self.items())[self.find(text)].get("toggle-state") == 1

    def click(self, text):
        call(self.dest, MENU, "com.canonical.dbusmenu", "Event",
             GLib.Variant("(isvu)", (self.find(text), "clicked", GLib.Variant("i", 0), 0)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def start_app(data, show=False):
    env = dict(os.environ, RMLX_APP_DATA=data, RMLX_APP_MODELS=MODEL)
    if show:
        env["RMLX_APP_SHOW"] = "1"
    log = open(os.path.join(ARTIFACTS, "app.log"), "ab")
    return subprocess.Popen([APP], env=env, stdout=log, stderr=log)


def stop_app(app):
    app.send_signal(signal.SIGTERM)
    try:
        app.wait(timeout=15)
    except subprocess.TimeoutExpired:
        app.kill()
        app.wait()


def screenshot(name):
    path = os.path.join(ARTIFACTS, name)
    subprocess.run(["import", "-window", "root", path], check=True)
    print(f"app-test: screenshot {path}")


def test_tray_switch_persistence_and_busy_port(data):
    port = free_port()
    with open(os.path.join(data, "settings.json"), "w") as f:
        json.dump({"server_port": port}, f)
    app = start_app(data, show=True)
    try:
        tray = Tray(app.pid)
        time.sleep(3)  # let the window draw before the screenshot
        screenshot("app-window.png")
        assert tray.status() == "Server: off", tray.items()
        assert not tray.checked("Local API server")
        assert not answers(port)

        tray.click("Local API server")
        wait("the port to answer", lambda: answers(port))
        wait("the status line", lambda: tray.status() == f"Server: on · http://127.0.0.1:{port}")
        assert tray.checked("Local API server")

        tray.click("Local API server")
        wait("the port to close", lambda: not answers(port))
        wait("the status line", lambda: tray.status() == "Server: off")

        tray.click("Local API server")
        wait("the port to answer again", lambda: answers(port))
    finally:
        stop_app(app)
    assert not answers(port), "the port outlived the app"
    saved = json.load(open(os.path.join(data, "settings.json")))
    assert saved["server_enabled"] is True and saved["server_port"] == port, saved
    print("app-test: tray switch on/off/on over D-Bus: ok")

    # The switch was on at exit: a new launch restores it.
    app = start_app(data)
    try:
        tray = Tray(app.pid)
        wait("the restored server", lambda: answers(port))
        wait("the checked item", lambda: tray.checked("Local API server"))
    finally:
        stop_app(app)
    print("app-test: the switch survives a restart: ok")

    # Someone else holds the port: the tray says so; the app keeps running.
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        app = start_app(data)
        try:
            tray = Tray(app.pid)
            message = f"Server: port {port} is in use; choose another port"
            wait("the busy-port message", lambda: tray.status() == message)
            assert not tray.checked("Local API server")
            assert app.poll() is None, "the app died on a busy port"
        finally:
            stop_app(app)
    print("app-test: a busy port is a message, not a crash: ok")


def main():
    os.makedirs(ARTIFACTS, exist_ok=True)
    with tempfile.TemporaryDirectory() as data:
        test_tray_switch_persistence_and_busy_port(data)


if __name__ == "__main__":
    main()
