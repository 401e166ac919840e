//! Status codes at the three layers a lab call passes through, and what the lab can
//! say about the lowest one.
//!
//! `nixl-sys` (Rust) → `libnixl_capi.so` (C API, `nixl_capi_status_t`) → `libnixl.so`
//! (`nixlAgent::*`, `nixl_status_t`, what a uprobe sees). Each layer folds codes: the C
//! API maps MISMATCH, NOT_ALLOWED, REMOTE_DISCONNECT, … all to `NIXL_CAPI_ERROR_BACKEND`
//! and `nixl_capi_create_xfer_req` returns BACKEND for *every* failure; `nixl-sys` folds
//! further (e.g. its `invalidate_remote_md` treats NOT_FOUND as success and
//! `check_remote_metadata` returns a bare bool). So a [`StatusSeen`] carries what the lab
//! observed (`nixl_sys`, and the C API code when it follows from that) and the native
//! `nixl_status_t` when it is determined: either the C API code maps back one-to-one, or
//! the lab knows which failure it injected (table in [`native_for_injection`], checked
//! against the 1.5.1 wheel with gdb breakpoints on the `nixlAgent` methods).

use serde::{Deserialize, Serialize};

use nixl_sys::NixlError;

/// `nixl_status_t` (NIXL 1.5.1 `nixl_types.h`).
pub mod native {
    /// NIXL_IN_PROG
    pub const IN_PROG: i32 = 1;
    /// NIXL_SUCCESS
    pub const SUCCESS: i32 = 0;
    /// NIXL_ERR_NOT_POSTED
    pub const ERR_NOT_POSTED: i32 = -1;
    /// NIXL_ERR_INVALID_PARAM
    pub const ERR_INVALID_PARAM: i32 = -2;
    /// NIXL_ERR_BACKEND
    pub const ERR_BACKEND: i32 = -3;
    /// NIXL_ERR_NOT_FOUND
    pub const ERR_NOT_FOUND: i32 = -4;
    /// NIXL_ERR_MISMATCH
    pub const ERR_MISMATCH: i32 = -5;
    /// NIXL_ERR_NOT_ALLOWED
    pub const ERR_NOT_ALLOWED: i32 = -6;
    /// NIXL_ERR_REPOST_ACTIVE
    pub const ERR_REPOST_ACTIVE: i32 = -7;
    /// NIXL_ERR_UNKNOWN
    pub const ERR_UNKNOWN: i32 = -8;
    /// NIXL_ERR_NOT_SUPPORTED
    pub const ERR_NOT_SUPPORTED: i32 = -9;
    /// NIXL_ERR_REMOTE_DISCONNECT
    pub const ERR_REMOTE_DISCONNECT: i32 = -10;
    /// NIXL_ERR_CANCELED
    pub const ERR_CANCELED: i32 = -11;
    /// NIXL_ERR_NO_TELEMETRY
    pub const ERR_NO_TELEMETRY: i32 = -12;

    /// The C enumerator's name.
    pub fn name(code: i32) -> &'static str {
        match code {
            IN_PROG => "NIXL_IN_PROG",
            SUCCESS => "NIXL_SUCCESS",
            ERR_NOT_POSTED => "NIXL_ERR_NOT_POSTED",
            ERR_INVALID_PARAM => "NIXL_ERR_INVALID_PARAM",
            ERR_BACKEND => "NIXL_ERR_BACKEND",
            ERR_NOT_FOUND => "NIXL_ERR_NOT_FOUND",
            ERR_MISMATCH => "NIXL_ERR_MISMATCH",
            ERR_NOT_ALLOWED => "NIXL_ERR_NOT_ALLOWED",
            ERR_REPOST_ACTIVE => "NIXL_ERR_REPOST_ACTIVE",
            ERR_UNKNOWN => "NIXL_ERR_UNKNOWN",
            ERR_NOT_SUPPORTED => "NIXL_ERR_NOT_SUPPORTED",
            ERR_REMOTE_DISCONNECT => "NIXL_ERR_REMOTE_DISCONNECT",
            ERR_CANCELED => "NIXL_ERR_CANCELED",
            ERR_NO_TELEMETRY => "NIXL_ERR_NO_TELEMETRY",
            _ => "unknown",
        }
    }
}

/// `nixl_capi_status_t` (`wrapper.h` of nixl-sys 1.5.1).
pub mod capi {
    /// NIXL_CAPI_SUCCESS
    pub const SUCCESS: i32 = 0;
    /// NIXL_CAPI_ERROR_INVALID_PARAM
    pub const ERROR_INVALID_PARAM: i32 = -1;
    /// NIXL_CAPI_ERROR_BACKEND (also every native error without a C API twin)
    pub const ERROR_BACKEND: i32 = -2;
    /// NIXL_CAPI_ERROR_INVALID_STATE
    pub const ERROR_INVALID_STATE: i32 = -3;
    /// NIXL_CAPI_ERROR_EXCEPTION
    pub const ERROR_EXCEPTION: i32 = -4;
    /// NIXL_CAPI_IN_PROG
    pub const IN_PROG: i32 = 1;
    /// NIXL_CAPI_ERROR_NO_TELEMETRY
    pub const ERROR_NO_TELEMETRY: i32 = -5;
    /// NIXL_CAPI_ERROR_NOT_FOUND
    pub const ERROR_NOT_FOUND: i32 = -6;

    /// The native `nixl_status_t` a C API code can only have come from, if unique.
    pub fn native_if_unique(code: i32) -> Option<i32> {
        use super::native;
        match code {
            SUCCESS => Some(native::SUCCESS),
            IN_PROG => Some(native::IN_PROG),
            ERROR_INVALID_PARAM => Some(native::ERR_INVALID_PARAM),
            ERROR_NOT_FOUND => Some(native::ERR_NOT_FOUND),
            ERROR_NO_TELEMETRY => Some(native::ERR_NO_TELEMETRY),
            _ => None,
        }
    }
}

/// What the lab saw from one NIXL call, and the native status when it is determined.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatusSeen {
    /// The `nixl-sys` result: `"Ok"`, `"InProgress"` or the `NixlError` variant name
    /// (`"NotFound"`, `"BackendError"`, `"FailedToCreateXferRequest"`, …).
    pub nixl_sys: String,
    /// The `nixl_capi_status_t` the C API returned, when `nixl_sys` pins it down.
    pub capi: Option<i32>,
    /// The `nixl_status_t` the `nixlAgent` method returned (what a uretprobe reads in
    /// eax), when determined; `None` when the folding above hides it.
    pub nixl: Option<i32>,
    /// Name of `nixl`, e.g. `"NIXL_ERR_MISMATCH"`.
    pub nixl_name: Option<String>,
}

impl StatusSeen {
    fn new(nixl_sys: &str, capi: Option<i32>, nixl: Option<i32>) -> Self {
        Self {
            nixl_sys: nixl_sys.to_string(),
            capi,
            nixl,
            nixl_name: nixl.map(|c| native::name(c).to_string()),
        }
    }

    /// A call that returned success (native `NIXL_SUCCESS`).
    pub fn ok() -> Self {
        Self::new("Ok", Some(capi::SUCCESS), Some(native::SUCCESS))
    }

    /// `post_xfer_req` / `get_xfer_status` said the transfer is still running.
    pub fn in_progress() -> Self {
        Self::new("InProgress", Some(capi::IN_PROG), Some(native::IN_PROG))
    }

    /// A `nixl-sys` error; `capi_of_failure` is the C API code when the wrapper is known
    /// to return one code for every failure (`nixl_capi_create_xfer_req`: BACKEND).
    pub fn from_error(e: &NixlError, injected_native: Option<i32>) -> Self {
        let capi = capi_of(e);
        let nixl = capi.and_then(capi::native_if_unique).or(injected_native);
        Self::new(error_name(e), capi, nixl)
    }

    /// `check_remote_metadata` returned `false`: the C API code is hidden by nixl-sys;
    /// `nixlAgent::checkRemoteMD` fails only with NIXL_ERR_NOT_FOUND for an empty list.
    pub fn check_not_found() -> Self {
        Self::new("false", None, Some(native::ERR_NOT_FOUND))
    }

    /// `check_remote_metadata` returned `true`.
    pub fn check_found() -> Self {
        Self::new("true", Some(capi::SUCCESS), Some(native::SUCCESS))
    }

    /// `invalidate_remote_md` returned `Ok`, which nixl-sys also reports when the C API
    /// said NOT_FOUND; `was_loaded` says which it was.
    pub fn invalidated(was_loaded: bool) -> Self {
        if was_loaded {
            Self::ok()
        } else {
            Self::new(
                "Ok",
                Some(capi::ERROR_NOT_FOUND),
                Some(native::ERR_NOT_FOUND),
            )
        }
    }

    /// True when the `nixlAgent` call succeeded (or is in progress): judged by the
    /// native code when known, else by what nixl-sys said.
    pub fn is_ok(&self) -> bool {
        match self.nixl {
            Some(code) => code >= 0,
            None => matches!(self.nixl_sys.as_str(), "Ok" | "InProgress" | "true"),
        }
    }
}

/// The C API status a `nixl-sys` error implies, when it implies exactly one.
pub fn capi_of(e: &NixlError) -> Option<i32> {
    match e {
        NixlError::InvalidParam => Some(capi::ERROR_INVALID_PARAM),
        NixlError::NotFound => Some(capi::ERROR_NOT_FOUND),
        NixlError::NoTelemetry => Some(capi::ERROR_NO_TELEMETRY),
        // nixl_capi_create_xfer_req returns BACKEND for any failed createXferReq.
        NixlError::FailedToCreateXferRequest => Some(capi::ERROR_BACKEND),
        // BACKEND, INVALID_STATE and EXCEPTION all land here; BACKEND is the one NIXL
        // errors map to, the other two come from the wrapper itself.
        NixlError::BackendError => None,
        _ => None,
    }
}

/// The variant name of a `nixl-sys` error.
pub fn error_name(e: &NixlError) -> &'static str {
    match e {
        NixlError::InvalidParam => "InvalidParam",
        NixlError::BackendError => "BackendError",
        NixlError::StringConversionError(_) => "StringConversionError",
        NixlError::IndexOutOfBounds => "IndexOutOfBounds",
        NixlError::InvalidDataPointer => "InvalidDataPointer",
        NixlError::FailedToCreateXferRequest => "FailedToCreateXferRequest",
        NixlError::RegDescListCreationFailed => "RegDescListCreationFailed",
        NixlError::RegDescAddFailed => "RegDescAddFailed",
        NixlError::FailedToCreateXferDlistHandle => "FailedToCreateXferDlistHandle",
        NixlError::FailedToCreateBackend => "FailedToCreateBackend",
        NixlError::NoTelemetry => "NoTelemetry",
        NixlError::NotFound => "NotFound",
    }
}

/// Which NIXL call an injected failure hits, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Injection {
    /// `loadRemoteMD` of a mangled metadata blob.
    CorruptMetadata,
    /// `fetchRemoteMD` from an address where no NIXL agent listens: the call returns
    /// success, the metadata never arrives (the "handshake never came back" path).
    DeadListener,
    /// `makeConnection` to an agent whose metadata was never loaded.
    UnknownConnect,
    /// `createXferReq` naming an agent whose metadata was never loaded.
    UnknownRemote,
    /// `invalidateRemoteMD`, then `createXferReq` to that agent.
    InvalidatedRemote,
    /// `createXferReq`, then `invalidateRemoteMD`, then `postXferReq`.
    InvalidatedBeforePost,
    /// `postXferReq` returning IN_PROG, then `invalidateRemoteMD`, then `getXferStatus`.
    InvalidatedInFlight,
    /// The remote agent was destroyed (its process gone, or its `nixlAgent` deleted)
    /// after its metadata was loaded; then a transfer to it.
    RemoteGone,
    /// `createXferReq` with one remote descriptor fewer than local ones
    /// (INVALID_PARAM, before the request is built).
    MismatchedDescriptors,
    /// `makeXferReq` with one remote index fewer than local ones (INVALID_PARAM, before
    /// the request is built).
    PreppedMismatchedIndices,
    /// `makeXferReq` with a remote index past its prepared list's end (INVALID_PARAM,
    /// once the request is built).
    PreppedIndexPastEnd,
}

/// The native status `method` (a `nixlAgent` method name) returns when it fails the way
/// `injection` intends, for the cases where the C API hides it (1.5.1; read from
/// `nixl_agent.cpp` and checked with gdb on the wheel's `libnixl.so`). `None` when the
/// injection does not make that call fail.
pub fn native_for_injection(injection: Injection, method: &str) -> Option<i32> {
    match (injection, method) {
        // nixlAgentData::loadRemoteMD: nixlSerDes import / tag errors → MISMATCH
        (Injection::CorruptMetadata, "loadRemoteMD") => Some(native::ERR_MISMATCH),
        // remoteBackends_ lookup
        (Injection::UnknownConnect, "makeConnection") => Some(native::ERR_NOT_FOUND),
        // remoteSections_ lookup
        (Injection::UnknownRemote | Injection::InvalidatedRemote, "createXferReq") => {
            Some(native::ERR_NOT_FOUND)
        }
        // "remote agent was invalidated after transfer request creation"
        (Injection::InvalidatedBeforePost, "postXferReq") => Some(native::ERR_NOT_FOUND),
        // "remote agent was invalidated during transfer"
        (Injection::InvalidatedInFlight, "getXferStatus") => Some(native::ERR_NOT_FOUND),
        // "different descriptor list sizes" (nixl-sys folds it into
        // FailedToCreateXferRequest), "different number of indices", "index out of range"
        (Injection::MismatchedDescriptors, "createXferReq")
        | (Injection::PreppedMismatchedIndices | Injection::PreppedIndexPastEnd, "makeXferReq") => {
            Some(native::ERR_INVALID_PARAM)
        }
        // backend postXfer on a UCX endpoint whose peer went away
        (Injection::RemoteGone, "postXferReq") => Some(native::ERR_REMOTE_DISCONNECT),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_capi_codes_map_back() {
        assert_eq!(
            capi::native_if_unique(capi::ERROR_NOT_FOUND),
            Some(native::ERR_NOT_FOUND)
        );
        assert_eq!(capi::native_if_unique(capi::ERROR_BACKEND), None);
        assert_eq!(capi::native_if_unique(capi::IN_PROG), Some(native::IN_PROG));
    }

    #[test]
    fn errors_keep_the_injected_native_code_only_when_the_capi_hides_it() {
        let s = StatusSeen::from_error(&NixlError::BackendError, Some(native::ERR_MISMATCH));
        assert_eq!(s.capi, None);
        assert_eq!(s.nixl, Some(-5));
        assert_eq!(s.nixl_name.as_deref(), Some("NIXL_ERR_MISMATCH"));
        // NOT_FOUND is unambiguous: the observed code wins over a wrong guess
        let s = StatusSeen::from_error(&NixlError::NotFound, Some(native::ERR_REMOTE_DISCONNECT));
        assert_eq!(s.nixl, Some(native::ERR_NOT_FOUND));
        let s = StatusSeen::from_error(&NixlError::FailedToCreateXferRequest, None);
        assert_eq!((s.capi, s.nixl), (Some(capi::ERROR_BACKEND), None));
    }

    #[test]
    fn invalidate_ok_distinguishes_not_found() {
        assert_eq!(
            StatusSeen::invalidated(false).nixl,
            Some(native::ERR_NOT_FOUND)
        );
        assert!(!StatusSeen::invalidated(false).is_ok()); // nixl-sys said Ok, NIXL did not
        assert_eq!(StatusSeen::invalidated(true), StatusSeen::ok());
    }
}
