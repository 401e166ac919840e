//! Which Dynamo the lab runs, and what starting that release on loopback takes, read off
//! the installed wheel rather than kept in a table per release.
//!
//! Releases differ in ways that decide whether a lab starts at all, and none of them is
//! announced by a flag `--help` lists:
//!
//! - `DYN_TCP_RESPONSE_STREAM_HOST` is an interface name up to 1.5 (`lo`; an address
//!   there fails with "Interface not found: 127.0.0.1" and no model is ever served) and
//!   an address from 1.6 on. The older builds carry that error's text; the lab looks for
//!   it.
//! - `DYN_EVENT_PLANE_HOST` exists from 1.6 on. Without it a ZMQ event plane advertises the
//!   machine's other address, which nothing here may do: such a release runs its event
//!   plane on the lab's NATS, and asking for ZMQ is refused with that reason.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The release the lab runs unless told otherwise (the newest on PyPI when last looked).
pub const DEFAULT_DYNAMO: &str = "1.6.1";

/// The native module every Dynamo wheel ships, relative to the venv's site-packages.
const CORE_MODULE: &str = "dynamo/_core.abi3.so";

/// The venv of `version` under `lab_dir`: `venv/` for [`DEFAULT_DYNAMO`], where every
/// test and script finds it, and `dynamo-<version>/venv/` for any other.
pub fn venv_dir(lab_dir: &Path, version: &str) -> PathBuf {
    if version == DEFAULT_DYNAMO {
        lab_dir.join("venv")
    } else {
        lab_dir.join(format!("dynamo-{version}")).join("venv")
    }
}

/// What the lab reads off an installed Dynamo to start it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynamoBuild {
    /// `ai-dynamo`'s version, as pip recorded it.
    pub version: String,
    /// `DYN_TCP_RESPONSE_STREAM_HOST` names an interface (`lo`), not an address.
    pub response_host_is_interface: bool,
    /// The build reads `DYN_EVENT_PLANE_HOST`: its ZMQ event plane can stay on loopback.
    pub event_plane_host: bool,
}

impl DynamoBuild {
    /// Reads the build installed in `venv`.
    pub fn read(venv: &Path) -> Result<Self> {
        let site = site_packages(venv)?;
        let version = installed_version(&site, "ai_dynamo")?;
        let core = site.join(CORE_MODULE);
        let bytes = std::fs::read(&core).with_context(|| format!("reading {}", core.display()))?;
        Ok(Self::from_core(version, &bytes))
    }

    /// What the native module `core` of release `version` says of itself.
    pub fn from_core(version: String, core: &[u8]) -> Self {
        let has = |needle: &str| memchr::memmem::find(core, needle.as_bytes()).is_some();
        Self {
            version,
            response_host_is_interface: has("Interface not found: "),
            event_plane_host: has("DYN_EVENT_PLANE_HOST"),
        }
    }

    /// The value of `DYN_TCP_RESPONSE_STREAM_HOST` that keeps the response stream on
    /// loopback.
    pub fn response_stream_host(&self) -> &'static str {
        if self.response_host_is_interface {
            "lo"
        } else {
            "127.0.0.1"
        }
    }
}

/// The one `lib/python3.*/site-packages` of `venv`.
fn site_packages(venv: &Path) -> Result<PathBuf> {
    let lib = venv.join("lib");
    let entries = std::fs::read_dir(&lib).with_context(|| format!("listing {}", lib.display()))?;
    for entry in entries.flatten() {
        let site = entry.path().join("site-packages");
        if entry.file_name().to_string_lossy().starts_with("python") && site.is_dir() {
            return Ok(site);
        }
    }
    anyhow::bail!("no python*/site-packages under {}", lib.display())
}

/// The version of the distribution whose normalized name is `dist` (`ai_dynamo`), from
/// its `.dist-info` folder's name.
fn installed_version(site: &Path, dist: &str) -> Result<String> {
    let prefix = format!("{dist}-");
    let entries = std::fs::read_dir(site).with_context(|| format!("listing {}", site.display()))?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(version) = name
            .strip_prefix(&prefix)
            .and_then(|rest| rest.strip_suffix(".dist-info"))
        {
            return Ok(version.to_string());
        }
    }
    anyhow::bail!("{dist} is not installed in {}", site.display())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_release_keeps_the_venv_every_test_knows() {
        let lab = Path::new("/l");
        assert_eq!(venv_dir(lab, DEFAULT_DYNAMO), Path::new("/l/venv"));
        assert_eq!(venv_dir(lab, "1.4.1"), Path::new("/l/dynamo-1.4.1/venv"));
    }

    #[test]
    fn what_a_build_says_of_itself() {
        let old = DynamoBuild::from_core("1.4.1".into(), b"..Interface not found: ..");
        assert_eq!(old.response_stream_host(), "lo");
        assert!(!old.event_plane_host);
        let new = DynamoBuild::from_core("1.6.1".into(), b"..DYN_EVENT_PLANE_HOST..");
        assert_eq!(new.response_stream_host(), "127.0.0.1");
        assert!(new.event_plane_host);
    }
}
