//! The imitation hub as a process, for tests outside Rust (the UI's browser suite, the app
//! test): `test_hub [--trickle-ms N] ORG/NAME=DIR...` serves each folder as a repository on a
//! free 127.0.0.1 port, prints `test-hub: serving on URL` as its first line, and stops when its
//! stdin closes (the test that started it went away) or on SIGTERM.

use std::{io::Read, time::Duration};

use rmlx_hub::testing::TestHub;

fn main() {
    let hub = TestHub::start();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--trickle-ms" {
            let millis: u64 = args
                .next()
                .and_then(|n| n.parse().ok())
                .expect("--trickle-ms takes a number of milliseconds");
            hub.set(|switches| switches.trickle = Some(Duration::from_millis(millis)));
        } else {
            let (repo, dir) = arg
                .split_once('=')
                .expect("repositories are given as ORG/NAME=DIR");
            hub.add_repo(repo, dir);
        }
    }
    println!("test-hub: serving on {}", hub.url());
    // Blocks until the parent closes our stdin (or dies); dropping the hub stops it.
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
}
