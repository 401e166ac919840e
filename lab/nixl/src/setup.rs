//! Downloads and unpacks the `nixl-cu12==1.5.1` wheel under `<lab dir>/nixl/`.
//! Idempotent: does nothing when the unpacked wheel is complete.
//!
//! - `<lab dir>/nixl/wheels/nixl_cu12-1.5.1-*.whl`: `pip download nixl-cu12==1.5.1
//!   --no-deps` with the lab venv's Python (`kvscope-lab setup` makes it), else `python3`;
//! - `<lab dir>/nixl/wheel/`: the wheel unpacked with Python's `zipfile` into a scratch
//!   folder first and renamed into place, so an interrupted unpack is never mistaken for
//!   a complete one.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use tracing::info;

use crate::libs::{
    NixlLibs, NIXL_SUBDIR, WHEELS_SUBDIR, WHEEL_FILE_PREFIX, WHEEL_REQUIREMENT, WHEEL_SUBDIR,
};

/// Why the wheel could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// No Python interpreter to run pip / zipfile with.
    #[error(
        "no Python found to download the NIXL wheel with (looked for {venv_python} and python3); \
         run `kvscope-lab setup` to create the lab venv"
    )]
    NoPython {
        /// The lab venv's interpreter path that was tried first.
        venv_python: PathBuf,
    },
    /// `pip download` failed (no network, no pip, index trouble, …).
    #[error(
        "`{python} -m pip download {WHEEL_REQUIREMENT} --no-deps` failed ({status}): {stderr_tail}"
    )]
    Download {
        /// Interpreter used.
        python: PathBuf,
        /// Exit status.
        status: String,
        /// The last lines pip printed on stderr.
        stderr_tail: String,
    },
    /// pip succeeded but no matching wheel file appeared.
    #[error("pip reported success but no {WHEEL_FILE_PREFIX}*.whl is in {dir}")]
    WheelMissing {
        /// The download folder.
        dir: PathBuf,
    },
    /// Unpacking failed.
    #[error("unpacking {wheel} failed ({status}): {stderr_tail}")]
    Unpack {
        /// The wheel file.
        wheel: PathBuf,
        /// Exit status.
        status: String,
        /// The last lines printed on stderr.
        stderr_tail: String,
    },
    /// The unpacked wheel lacks a file the lab needs.
    #[error("the unpacked wheel at {dir} has no {missing}")]
    Incomplete {
        /// The unpacked folder.
        dir: PathBuf,
        /// The missing file.
        missing: PathBuf,
    },
    /// A file-system operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The libraries could not be read after unpacking.
    #[error(transparent)]
    Libs(#[from] crate::libs::LibsError),
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> SetupError + 'a {
    move |source| SetupError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Makes sure the wheel is downloaded and unpacked under `lab_dir`, then returns where
/// its libraries are.
pub fn ensure_wheel(lab_dir: &Path) -> Result<NixlLibs, SetupError> {
    if let Ok(libs) = NixlLibs::locate(lab_dir) {
        info!(lib_dir = %libs.lib_dir.display(), build_id = ?libs.build_id, "NIXL wheel already unpacked.");
        return Ok(libs);
    }
    let nixl_dir = lab_dir.join(NIXL_SUBDIR);
    let wheels_dir = nixl_dir.join(WHEELS_SUBDIR);
    let wheel_dir = nixl_dir.join(WHEEL_SUBDIR);
    std::fs::create_dir_all(&wheels_dir).map_err(io("creating", &wheels_dir))?;

    let wheel = match find_wheel(&wheels_dir)? {
        Some(w) => w,
        None => {
            let python = python(lab_dir)?;
            info!(requirement = WHEEL_REQUIREMENT, dest = %wheels_dir.display(), "Downloading the NIXL wheel (~70 MB).");
            let out = Command::new(&python)
                .args([
                    "-m",
                    "pip",
                    "download",
                    "--disable-pip-version-check",
                    "--no-deps",
                    "-d",
                ])
                .arg(&wheels_dir)
                .arg(WHEEL_REQUIREMENT)
                .stdin(Stdio::null())
                .output()
                .map_err(io("running", &python))?;
            if !out.status.success() {
                return Err(SetupError::Download {
                    python,
                    status: out.status.to_string(),
                    stderr_tail: tail(&out.stderr),
                });
            }
            find_wheel(&wheels_dir)?.ok_or(SetupError::WheelMissing {
                dir: wheels_dir.clone(),
            })?
        }
    };

    let scratch = nixl_dir.join(format!("wheel.unpacking-{}", std::process::id()));
    if scratch.exists() {
        std::fs::remove_dir_all(&scratch).map_err(io("removing", &scratch))?;
    }
    let python = python(lab_dir)?;
    info!(wheel = %wheel.display(), "Unpacking the NIXL wheel.");
    let out = Command::new(&python)
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&scratch)
        .stdin(Stdio::null())
        .output()
        .map_err(io("running", &python))?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&scratch);
        return Err(SetupError::Unpack {
            wheel,
            status: out.status.to_string(),
            stderr_tail: tail(&out.stderr),
        });
    }
    if let Some(missing) = NixlLibs::at_wheel_dir(&nixl_dir, &scratch).first_missing() {
        let _ = std::fs::remove_dir_all(&scratch);
        return Err(SetupError::Incomplete {
            dir: scratch,
            missing,
        });
    }
    if wheel_dir.exists() {
        // An incomplete earlier unpack (locate() failed above): replace it.
        std::fs::remove_dir_all(&wheel_dir).map_err(io("removing the incomplete", &wheel_dir))?;
    }
    std::fs::rename(&scratch, &wheel_dir).map_err(io("renaming into place", &scratch))?;
    let libs = NixlLibs::locate(lab_dir)?;
    info!(lib_dir = %libs.lib_dir.display(), build_id = ?libs.build_id, "NIXL wheel ready.");
    Ok(libs)
}

/// The downloaded wheel file, if any.
fn find_wheel(dir: &Path) -> Result<Option<PathBuf>, SetupError> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io("listing", dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(WHEEL_FILE_PREFIX) && n.ends_with(".whl"))
        })
        .collect();
    found.sort();
    Ok(found.pop())
}

/// The lab venv's Python, else `python3` from PATH.
fn python(lab_dir: &Path) -> Result<PathBuf, SetupError> {
    let venv_python = kvscope_lab::paths::venv_python(lab_dir);
    if venv_python.exists() {
        return Ok(venv_python);
    }
    let works = Command::new("python3")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if works {
        Ok(PathBuf::from("python3"))
    } else {
        Err(SetupError::NoPython { venv_python })
    }
}

fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_only_the_pinned_wheel() {
        let dir =
            std::env::temp_dir().join(format!("kvscope-nixl-setup-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("nixl_cu12-1.4.0-cp311-cp311-manylinux_2_28_x86_64.whl"),
            b"",
        )
        .unwrap();
        std::fs::write(
            dir.join("nixl_cu12-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl.part"),
            b"",
        )
        .unwrap();
        assert_eq!(find_wheel(&dir).unwrap(), None);
        std::fs::write(
            dir.join("nixl_cu12-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl"),
            b"",
        )
        .unwrap();
        assert!(find_wheel(&dir).unwrap().is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        assert_eq!(tail(b"a\nb\n\nc\nd\ne\nf\n"), "b | c | d | e | f");
    }
}
