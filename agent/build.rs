//! Compiles the NIXL BPF programs in `ebpf/nixl/` with clang (`-target bpf`) into
//! `$OUT_DIR/nixl.bpf.o`, which `src/nixl/probes.rs` embeds. Debian: `apt-get install
//! clang libbpf-dev` (scripts/setup does it).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let src_dir = manifest.join("..").join("ebpf").join("nixl");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets it")).join("nixl.bpf.o");
    println!("cargo:rerun-if-changed={}", src_dir.display());
    println!("cargo:rerun-if-env-changed=KVSCOPE_BPF_CLANG");
    let clang = std::env::var("KVSCOPE_BPF_CLANG").unwrap_or_else(|_| "clang".into());
    let status = Command::new(&clang)
        .args([
            "-g",
            "-O2",
            "-target",
            "bpf",
            "-D__TARGET_ARCH_x86",
            "-Wall",
            "-Werror",
        ])
        // Debian keeps <asm/...> under the multiarch include folder, which clang's
        // bpf target does not search by itself.
        .arg("-I/usr/include/x86_64-linux-gnu")
        .arg("-c")
        .arg(src_dir.join("nixl.bpf.c"))
        .arg("-o")
        .arg(&out)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!(
            "clang failed ({s}) compiling {}: the BPF programs need clang and libbpf-dev \
             (Debian: apt-get install clang libbpf-dev; scripts/setup installs them)",
            src_dir.join("nixl.bpf.c").display()
        ),
        Err(e) => panic!(
            "cannot run `{clang}` ({e}): the agent's BPF programs need clang and libbpf-dev \
             (Debian: apt-get install clang libbpf-dev; scripts/setup installs them), or set \
             KVSCOPE_BPF_CLANG to a clang binary"
        ),
    }
}
