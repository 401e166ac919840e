//! Where the NIXL 1.5.1 wheel's libraries are, and the environment a process needs to
//! run them.
//!
//! The wheel `nixl-cu12==1.5.1` is unpacked under `<lab dir>/nixl/wheel/` (see
//! [`crate::setup`]). Its NIXL libraries sit in `.nixl_cu12.mesonpy.libs/` (`libnixl.so`,
//! `libnixl_capi.so`, …, with `RPATH $ORIGIN:$ORIGIN/../nixl_cu12.libs`, so their own
//! dependencies — UCX, gRPC, … — resolve by themselves) and the backends in its
//! `plugins/` folder. A process using them through `nixl-sys` (feature `stub-api`) needs:
//!
//! - `LD_LIBRARY_PATH` containing the libs folder **before the process starts**: the
//!   stubs call `dlopen("libnixl_capi.so")` by bare name and the dynamic loader reads
//!   `LD_LIBRARY_PATH` once, at start-up;
//! - `NIXL_PLUGIN_DIR` = the `plugins/` folder (NIXL looks for `libplugin_UCX.so` there).
//!
//! And two that keep its traffic on loopback, as every socket on the lab machines must:
//!
//! - `UCX_NET_DEVICES=lo`: left alone, UCX picks the machine's other interface (seen
//!   listening on a 192.0.2.x address); shared memory transports are not network
//!   devices and stay available;
//! - `LD_PRELOAD` of the loopback shim ([`kvscope_lab::loopback`], written next to the
//!   wheel as `loopback_bind.so`): NIXL's metadata listener binds
//!   `INADDR_ANY` and has no setting for it, so every bind to "any address" in the
//!   process becomes a bind to 127.0.0.1.
//!
//! [`NixlLibs::child_env`] gives all four for a child process; the `kvscope-nixl-lab`
//! binary re-executes itself with them when started without.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

/// The NIXL release the lab runs.
pub const NIXL_VERSION: &str = "1.5.1";
/// The pip requirement for the wheel that carries it.
pub const WHEEL_REQUIREMENT: &str = "nixl-cu12==1.5.1";
/// File-name prefix of that wheel (`nixl_cu12-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl`).
pub const WHEEL_FILE_PREFIX: &str = "nixl_cu12-1.5.1-";
/// GNU build-id of the wheel's `libnixl.so` as checked on the lab machines.
pub const KNOWN_LIBNIXL_BUILD_ID: &str = "c60ac851fdd67a4d9738b5b2f53bd4849505f241";
/// The `nixl-sys` crate version the lab is built against (same NIXL release).
pub const NIXL_SYS_VERSION: &str = "1.5.1";

/// Where NIXL looks for its backend plugins.
pub const PLUGIN_DIR_ENV: &str = "NIXL_PLUGIN_DIR";
/// The dynamic loader's search path (read once, when a process starts).
pub const LD_LIBRARY_PATH_ENV: &str = "LD_LIBRARY_PATH";
pub use kvscope_lab::loopback::LD_PRELOAD_ENV;
/// The network devices UCX may use.
pub const UCX_NET_DEVICES_ENV: &str = "UCX_NET_DEVICES";
use kvscope_lab::loopback::LOOPBACK_SHIM_FILE;

/// The folder under `<lab dir>` that holds everything NIXL.
pub(crate) const NIXL_SUBDIR: &str = "nixl";
/// Downloaded wheel files.
pub(crate) const WHEELS_SUBDIR: &str = "wheels";
/// The unpacked wheel.
pub(crate) const WHEEL_SUBDIR: &str = "wheel";
/// NIXL's own libraries inside the unpacked wheel.
const MESON_LIBS_SUBDIR: &str = ".nixl_cu12.mesonpy.libs";
/// Bundled third-party libraries (UCX, gRPC, …) inside the unpacked wheel.
const BUNDLED_LIBS_SUBDIR: &str = "nixl_cu12.libs";

/// Why the wheel's libraries cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LibsError {
    /// The wheel is not unpacked (or is incomplete) under the lab dir.
    #[error(
        "the NIXL {NIXL_VERSION} wheel is not set up under {dir} (missing {missing}); \
         run `kvscope-nixl-lab setup` (or `cargo run -p kvscope-nixl-lab -- setup`) first"
    )]
    NotSetUp {
        /// The `<lab dir>/nixl` folder.
        dir: PathBuf,
        /// The first expected file that is absent.
        missing: PathBuf,
    },
    /// Writing the loopback shim failed.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Reading a library file failed.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// The wheel's libraries, found on disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlLibs {
    /// `<lab dir>/nixl`.
    pub nixl_dir: PathBuf,
    /// The unpacked wheel, `<lab dir>/nixl/wheel`.
    pub wheel_dir: PathBuf,
    /// NIXL's libraries (`…/wheel/.nixl_cu12.mesonpy.libs`): goes on `LD_LIBRARY_PATH`.
    pub lib_dir: PathBuf,
    /// The backend plugins (`…/.nixl_cu12.mesonpy.libs/plugins`): `NIXL_PLUGIN_DIR`.
    pub plugin_dir: PathBuf,
    /// The bundled UCX/gRPC/… libraries (`…/wheel/nixl_cu12.libs`), found through RPATH.
    pub bundled_dir: PathBuf,
    /// `libnixl.so`: the file the `nixlAgent` uprobes attach to.
    pub libnixl: PathBuf,
    /// `libnixl_capi.so`: the C API `nixl-sys` dlopens.
    pub libnixl_capi: PathBuf,
    /// `plugins/libplugin_UCX.so`.
    pub ucx_plugin: PathBuf,
    /// The loopback shim preloaded into NIXL processes (see the module docs).
    pub loopback_shim: PathBuf,
    /// GNU build-id of `libnixl.so` (hex), when the file has one.
    pub build_id: Option<String>,
    /// The NIXL release ([`NIXL_VERSION`]).
    pub version: String,
}

impl NixlLibs {
    /// Finds the unpacked wheel under `lab_dir` without downloading anything.
    ///
    /// Fails with [`LibsError::NotSetUp`] (whose message says to run
    /// `kvscope-nixl-lab setup`) when a needed file is missing.
    pub fn locate(lab_dir: &Path) -> Result<Self, LibsError> {
        let nixl_dir = lab_dir.join(NIXL_SUBDIR);
        let wheel_dir = nixl_dir.join(WHEEL_SUBDIR);
        let libs = Self::at_wheel_dir(&nixl_dir, &wheel_dir);
        if let Some(missing) = libs.first_missing() {
            return Err(LibsError::NotSetUp {
                dir: nixl_dir,
                missing,
            });
        }
        let build_id = read_build_id(&libs.libnixl)?;
        write_shim(&libs.loopback_shim)?;
        Ok(Self { build_id, ..libs })
    }

    /// Uses the NIXL libraries in `lib_dir` (a folder laid out like the wheel's
    /// `.nixl_cu12.mesonpy.libs`: `libnixl.so`, `libnixl_capi.so`, `plugins/`, with the
    /// bundled libraries at `../nixl_cu12.libs`), e.g. a copy of another build.
    pub fn from_lib_dir(lib_dir: &Path) -> Result<Self, LibsError> {
        let wheel_dir = lib_dir.parent().unwrap_or(lib_dir).to_path_buf();
        let mut libs = Self::at_wheel_dir(&wheel_dir, &wheel_dir);
        libs.lib_dir = lib_dir.to_path_buf();
        libs.plugin_dir = lib_dir.join("plugins");
        libs.libnixl = lib_dir.join("libnixl.so");
        libs.libnixl_capi = lib_dir.join("libnixl_capi.so");
        libs.ucx_plugin = libs.plugin_dir.join("libplugin_UCX.so");
        if let Some(missing) = libs.first_missing() {
            return Err(LibsError::NotSetUp {
                dir: lib_dir.to_path_buf(),
                missing,
            });
        }
        libs.build_id = read_build_id(&libs.libnixl)?;
        write_shim(&libs.loopback_shim)?;
        Ok(libs)
    }

    /// Makes sure the wheel is downloaded and unpacked under `lab_dir` (see
    /// [`crate::setup::ensure_wheel`]), then finds it.
    pub fn ensure(lab_dir: &Path) -> Result<Self, crate::setup::SetupError> {
        crate::setup::ensure_wheel(lab_dir)
    }

    /// The layout for an unpacked wheel at `wheel_dir` (no checks).
    pub(crate) fn at_wheel_dir(nixl_dir: &Path, wheel_dir: &Path) -> Self {
        let lib_dir = wheel_dir.join(MESON_LIBS_SUBDIR);
        let plugin_dir = lib_dir.join("plugins");
        Self {
            nixl_dir: nixl_dir.to_path_buf(),
            wheel_dir: wheel_dir.to_path_buf(),
            libnixl: lib_dir.join("libnixl.so"),
            libnixl_capi: lib_dir.join("libnixl_capi.so"),
            ucx_plugin: plugin_dir.join("libplugin_UCX.so"),
            bundled_dir: wheel_dir.join(BUNDLED_LIBS_SUBDIR),
            loopback_shim: nixl_dir.join(LOOPBACK_SHIM_FILE),
            lib_dir,
            plugin_dir,
            build_id: None,
            version: NIXL_VERSION.to_string(),
        }
    }

    /// The first file or folder the lab needs that is absent.
    pub(crate) fn first_missing(&self) -> Option<PathBuf> {
        [
            &self.libnixl,
            &self.libnixl_capi,
            &self.ucx_plugin,
            &self.bundled_dir,
        ]
        .into_iter()
        .find(|p| !p.exists())
        .cloned()
    }

    /// The environment a child process needs to use these libraries:
    /// `LD_LIBRARY_PATH` (the libs folder first, then whatever `current` held) and
    /// `NIXL_PLUGIN_DIR`.
    pub fn child_env_with(
        &self,
        current_ld_library_path: Option<&std::ffi::OsStr>,
    ) -> Vec<(String, OsString)> {
        let mut dirs = vec![self.lib_dir.clone()];
        if let Some(current) = current_ld_library_path {
            dirs.extend(
                std::env::split_paths(current)
                    .filter(|d| *d != self.lib_dir && !d.as_os_str().is_empty()),
            );
        }
        let ld =
            std::env::join_paths(dirs).unwrap_or_else(|_| self.lib_dir.clone().into_os_string());
        vec![
            (LD_LIBRARY_PATH_ENV.to_string(), ld),
            (
                PLUGIN_DIR_ENV.to_string(),
                self.plugin_dir.clone().into_os_string(),
            ),
            (UCX_NET_DEVICES_ENV.to_string(), "lo".into()),
            (
                LD_PRELOAD_ENV.to_string(),
                self.loopback_shim.clone().into_os_string(),
            ),
        ]
    }

    /// [`Self::child_env_with`] this process's own `LD_LIBRARY_PATH`.
    pub fn child_env(&self) -> Vec<(String, OsString)> {
        self.child_env_with(std::env::var_os(LD_LIBRARY_PATH_ENV).as_deref())
    }

    /// Sets [`Self::child_env`] on `cmd`.
    pub fn apply_env(&self, cmd: &mut Command) {
        for (k, v) in self.child_env() {
            cmd.env(k, v);
        }
    }

    /// True when this process was started with the environment the libraries need:
    /// the libs folder first on `LD_LIBRARY_PATH` (so no other copy of
    /// `libnixl_capi.so` wins) and `NIXL_PLUGIN_DIR` = the plugins folder.
    pub fn env_ready(&self) -> bool {
        let on_path = std::env::var_os(LD_LIBRARY_PATH_ENV)
            .and_then(|v| std::env::split_paths(&v).find(|d| !d.as_os_str().is_empty()))
            .is_some_and(|first| same_dir(&first, &self.lib_dir));
        let plugins = std::env::var_os(PLUGIN_DIR_ENV)
            .map(|v| same_dir(Path::new(&v), &self.plugin_dir))
            .unwrap_or(false);
        let loopback = std::env::var_os(UCX_NET_DEVICES_ENV).is_some_and(|v| v == "lo")
            && std::env::var_os(LD_PRELOAD_ENV)
                .is_some_and(|v| Path::new(&v) == self.loopback_shim.as_path());
        on_path && plugins && loopback
    }

    /// `export` lines for a POSIX shell (`eval "$(kvscope-nixl-lab env)"`).
    pub fn shell_exports(&self) -> String {
        self.child_env()
            .into_iter()
            .map(|(k, v)| format!("export {k}={}\n", shell_quote(&v.to_string_lossy())))
            .collect()
    }
}

/// Write the loopback shim next to the wheel ([`kvscope_lab::loopback::write_shim`]).
fn write_shim(path: &Path) -> Result<(), LibsError> {
    kvscope_lab::loopback::write_shim(path).map_err(|source| LibsError::Write {
        path: path.to_path_buf(),
        source,
    })
}

fn same_dir(a: &Path, b: &Path) -> bool {
    a == b
        || match (a.canonicalize(), b.canonicalize()) {
            (Ok(x), Ok(y)) => x == y,
            _ => false,
        }
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Reads the GNU build-id note of an ELF file.
pub fn read_build_id(path: &Path) -> Result<Option<String>, LibsError> {
    let bytes = std::fs::read(path).map_err(|source| LibsError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(elf_build_id(&bytes))
}

/// The GNU build-id (`NT_GNU_BUILD_ID` in a `PT_NOTE` segment) of a 64-bit
/// little-endian ELF image, as lowercase hex. `None` for anything else.
pub fn elf_build_id(elf: &[u8]) -> Option<String> {
    const PT_NOTE: u32 = 4;
    const NT_GNU_BUILD_ID: u32 = 3;
    if elf.get(0..4)? != b"\x7fELF" || *elf.get(4)? != 2 || *elf.get(5)? != 1 {
        return None; // not ELF64 little-endian
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(elf.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(elf.get(o..o + 8)?.try_into().ok()?));
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    for i in 0..phnum {
        let ph = phoff.checked_add(i.checked_mul(phentsize)?)?;
        if u32_at(ph)? != PT_NOTE {
            continue;
        }
        let off = usize::try_from(u64_at(ph + 0x08)?).ok()?;
        let size = usize::try_from(u64_at(ph + 0x20)?).ok()?;
        let notes = elf.get(off..off.checked_add(size)?)?;
        let mut at = 0usize;
        while at + 12 <= notes.len() {
            let rd = |o: usize| -> Option<usize> {
                Some(u32::from_le_bytes(notes.get(o..o + 4)?.try_into().ok()?) as usize)
            };
            let (namesz, descsz, kind) = (rd(at)?, rd(at + 4)?, rd(at + 8)?);
            let name_at = at + 12;
            let desc_at = name_at + namesz.next_multiple_of(4);
            let next = desc_at + descsz.next_multiple_of(4);
            if kind as u32 == NT_GNU_BUILD_ID && notes.get(name_at..name_at + namesz)? == b"GNU\0" {
                let desc = notes.get(desc_at..desc_at + descsz)?;
                return Some(desc.iter().map(|b| format!("{b:02x}")).collect());
            }
            at = next;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF64 LE image: header, one PT_NOTE program header, and a note area
    /// holding an unrelated note followed by the build-id note.
    fn fake_elf(build_id: &[u8]) -> Vec<u8> {
        let mut notes = Vec::new();
        // an NT_GNU_ABI_TAG-like note first (type 1), name "GNU\0", 16-byte desc
        notes.extend_from_slice(&4u32.to_le_bytes());
        notes.extend_from_slice(&16u32.to_le_bytes());
        notes.extend_from_slice(&1u32.to_le_bytes());
        notes.extend_from_slice(b"GNU\0");
        notes.extend_from_slice(&[0u8; 16]);
        // the build-id note
        notes.extend_from_slice(&4u32.to_le_bytes());
        notes.extend_from_slice(&(build_id.len() as u32).to_le_bytes());
        notes.extend_from_slice(&3u32.to_le_bytes());
        notes.extend_from_slice(b"GNU\0");
        notes.extend_from_slice(build_id);
        while notes.len() % 4 != 0 {
            notes.push(0);
        }
        let phoff = 64u64;
        let phentsize = 56u16;
        let notes_off = phoff + u64::from(phentsize);
        let mut elf = vec![0u8; 64];
        elf[0..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2; // ELFCLASS64
        elf[5] = 1; // little-endian
        elf[0x20..0x28].copy_from_slice(&phoff.to_le_bytes());
        elf[0x36..0x38].copy_from_slice(&phentsize.to_le_bytes());
        elf[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        let mut ph = vec![0u8; 56];
        ph[0..4].copy_from_slice(&4u32.to_le_bytes()); // PT_NOTE
        ph[0x08..0x10].copy_from_slice(&notes_off.to_le_bytes());
        ph[0x20..0x28].copy_from_slice(&(notes.len() as u64).to_le_bytes());
        elf.extend_from_slice(&ph);
        elf.extend_from_slice(&notes);
        elf
    }

    #[test]
    fn reads_gnu_build_id_after_other_notes() {
        let id = [0xc6, 0x0a, 0xc8, 0x51, 0xfd, 0xd6, 0x7a, 0x4d];
        assert_eq!(
            elf_build_id(&fake_elf(&id)).as_deref(),
            Some("c60ac851fdd67a4d")
        );
    }

    #[test]
    fn rejects_non_elf_and_truncated_images() {
        assert_eq!(elf_build_id(b"not an elf at all"), None);
        let elf = fake_elf(&[1, 2, 3, 4]);
        assert_eq!(elf_build_id(&elf[..70]), None);
    }

    #[test]
    fn child_env_puts_the_libs_first_and_keeps_the_rest() {
        let libs = NixlLibs::at_wheel_dir(Path::new("/lab/nixl"), Path::new("/lab/nixl/wheel"));
        let env = libs.child_env_with(Some(std::ffi::OsStr::new(
            "/opt/x:/lab/nixl/wheel/.nixl_cu12.mesonpy.libs",
        )));
        assert_eq!(env[0].0, "LD_LIBRARY_PATH");
        assert_eq!(env[0].1, "/lab/nixl/wheel/.nixl_cu12.mesonpy.libs:/opt/x");
        assert_eq!(
            env[1],
            (
                "NIXL_PLUGIN_DIR".to_string(),
                "/lab/nixl/wheel/.nixl_cu12.mesonpy.libs/plugins".into()
            )
        );
    }

    #[test]
    fn from_lib_dir_lays_out_a_copy_and_checks_it() {
        let dir =
            std::env::temp_dir().join(format!("kvscope-nixl-libdir-test-{}", std::process::id()));
        let err = NixlLibs::from_lib_dir(&dir.join("libs")).unwrap_err();
        assert!(err.to_string().contains("libnixl.so"), "{err}");
        let libs = NixlLibs::at_wheel_dir(&dir, &dir);
        assert_eq!(libs.bundled_dir, dir.join("nixl_cu12.libs"));
    }

    #[test]
    fn locate_names_the_setup_command_when_missing() {
        let dir =
            std::env::temp_dir().join(format!("kvscope-nixl-libs-test-{}", std::process::id()));
        let err = NixlLibs::locate(&dir).unwrap_err();
        assert!(err.to_string().contains("kvscope-nixl-lab setup"), "{err}");
    }
}
