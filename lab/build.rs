//! Builds the loopback shim (`shim/loopback_bind.c`) that the labs preload into the
//! processes they start; the library is embedded in the crate and written out at run
//! time (see `loopback.rs`).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let src = "shim/loopback_bind.c";
    println!("cargo:rerun-if-changed={src}");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let lib = out.join("loopback_bind.so");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-o"])
        .arg(&lib)
        .arg(src)
        .arg("-ldl")
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cc:?} for {src}: {e}"));
    assert!(status.success(), "{cc} failed on {src}: {status}");
}
