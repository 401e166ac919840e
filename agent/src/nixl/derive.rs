//! The probes' struct offsets read from a `libnixl.so` build's own instructions, so
//! that any x86-64 build is traced bytes included — a wheel of another version, or a
//! library built from source whose build-id no table will ever hold.
//!
//! Each field is named by instructions that touch it in a few exported methods (the
//! recipe ARCHITECTURE.md, "NIXL struct offsets", gives): the methods are decoded with
//! `iced-x86` and run symbolically, one pass in address order, tracking which registers
//! and frame slots hold an argument's address plus a constant, or the 8 bytes read
//! there. A field is derived from one pattern and confirmed by every other instruction
//! that names it (the agreement is counted); a field no pattern finds, or two patterns
//! disagree on, is unknown with the reason, and then no field is read at all (the
//! probes' other figures stay exact).
//!
//! What each method gives (arguments: 0 is `this`):
//! - `getXferTelemetry(req, telemetry&)` copies the request's telemetry block into the
//!   caller's `nixlXferTelemetry` (`startTime`, `postDuration`, `xferDuration`,
//!   `totalBytes`, `descCount`, 8 bytes each): bytes and descriptors are where the
//!   copies of offsets 0x18 and 0x20 come from; its first 4-byte read of the request is
//!   the status; its first read of `this` is the agent's data pointer.
//! - `postXferReq(req, …)` hands the backend `(op&, local, remote, remoteAgent&,
//!   handle&, …)` through a virtual call: the op and the remote agent's name are the
//!   request fields in `rsi` and `r8`; the status is the request field the call's answer
//!   is stored to; `hasNotif` is the byte it sets to 1 after copying the notification
//!   into the string its last call before was given in `rdi`.
//! - `getXferStatus(req)` stores the backend's answer in the status.
//! - `nixlAgentData(name&, config&)` builds the agent's name first: its string's
//!   pointer is set to its own inline buffer 16 bytes on, its length to the argument's.
//! - `registerMem(descs&, …)` sums the descriptors' lengths in a loop: the vector's
//!   begin (its end 8 bytes after), the stride the pointer advances by, the length's
//!   offset in a descriptor.

use std::collections::HashMap;

use iced_x86::{
    Decoder, DecoderOptions, Formatter, GasFormatter, Instruction, InstructionInfoFactory,
    Mnemonic, OpAccess, OpKind, Register,
};

use super::offsets::{Counts, NixlOffsets, SiteReg, REQ_WINDOW};

mod aarch64;
mod creation_sites;
mod end_sites;
mod listing;
mod post_site;
pub use creation_sites::{CreationSites, Creator, Failure};
pub use end_sites::EndSites;
pub use post_site::PostSite;

/// The methods read, by the prefix of their mangled names.
pub(crate) const TELEMETRY: &str = "_ZNK9nixlAgent16getXferTelemetryE";
pub const POST: &str = "_ZNK9nixlAgent11postXferReqE";
pub(crate) const STATUS: &str = "_ZNK9nixlAgent13getXferStatusE";
pub(crate) const REGISTER: &str = "_ZN9nixlAgent11registerMemE";
pub(crate) const DATA_CTOR: &str = "_ZN13nixlAgentDataC2E";
pub const CREATE: &str = "_ZNK9nixlAgent13createXferReqE";
pub(crate) const RELEASE: &str = "_ZNK9nixlAgent14releaseXferReqE";
/// `makeXferReq`'s overloads: the span one (1.5 on), the std::vector one taking its op
/// by reference (every build; before 1.5 the implementation, in 1.5 a wrapper).
pub(crate) const MAKE_SPAN: &str = "_ZNK9nixlAgent11makeXferReqE14nixl_xfer_op_t";
pub(crate) const MAKE_BY_REFERENCE: &str = "_ZNK9nixlAgent11makeXferReqERK14nixl_xfer_op_t";

/// Every method a derivation reads.
pub const METHODS: [&str; 6] = [TELEMETRY, POST, STATUS, REGISTER, DATA_CTOR, CREATE];

/// The instruction set a build is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Everything is derived: the offsets and every completion site.
    X86_64,
    /// The offsets only (one struct layout with the x86-64 build of a version): the
    /// probes and their sites are x86-64's.
    Aarch64,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::X86_64 => "x86-64",
            Isa::Aarch64 => "aarch64",
        }
    }
}

/// A method's machine code as the library holds it.
#[derive(Clone, Copy, Debug)]
pub struct MethodCode<'a> {
    /// Its virtual address (what the evidence is shown against).
    pub address: u64,
    pub bytes: &'a [u8],
}

/// One field: its offset, or why it is unknown, and the instructions that gave it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    pub value: Option<u64>,
    /// `method+0xNN: instruction` for every instruction that named the value.
    pub evidence: Vec<String>,
    pub unknown_because: Option<String>,
}

/// What was derived from one library.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Derivation {
    /// What the build is compiled for: sites are placed on x86-64 builds only.
    pub isa: Isa,
    pub fields: Vec<Field>,
    /// When the request's byte and descriptor counts hold the transfer's: builds
    /// before 1.4 fill them in `createXferReq` only while the agent's telemetry is
    /// enabled (else they hold whatever the allocator left).
    pub counts: Counts,
    /// The instructions that say so, or why they are never read.
    pub counts_because: String,
    /// Where `getXferTelemetry` refuses an agent whose telemetry is off, or why it
    /// was not found.
    pub telemetry_refused: Result<RefusedSite, String>,
    /// Where transfers end (`getXferStatus`' answers, in-flight releases), or why
    /// they are not known.
    pub end_sites: Result<EndSites, String>,
    /// Where `postXferReq`'s status is final on every return, or why it is not known.
    pub post_site: Result<PostSite, String>,
    /// Where `createXferReq` fails, or why it is not known.
    pub create_sites: Result<CreationSites, String>,
    /// Where `makeXferReq` (the overload that implements it) fails, or why not known.
    pub make_sites: Result<CreationSites, String>,
}

/// The first instruction of the path on which `getXferTelemetry` returns
/// `NIXL_ERR_NO_TELEMETRY`: entered only when the agent's telemetry is off (vLLM asks for
/// every transfer's telemetry; a build or agent without it fails them all). `rdi` holds
/// the agent and `rsi` the request there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefusedSite {
    /// Its virtual address (often in the method's cold part, outside its symbol).
    pub address: u64,
    pub evidence: Vec<String>,
}

/// `NIXL_ERR_NO_TELEMETRY`.
const ERR_NO_TELEMETRY: i32 = -12;

impl Derivation {
    /// The offsets, when every field was derived and the request's fields fit the
    /// window the probes copy; else the reasons, one per unknown field.
    pub fn offsets(&self) -> Result<NixlOffsets, String> {
        let unknown: Vec<String> = self
            .fields
            .iter()
            .filter(|f| f.value.is_none())
            .map(|f| {
                format!(
                    "{}: {}",
                    f.name,
                    f.unknown_because.as_deref().unwrap_or("not found")
                )
            })
            .collect();
        if !unknown.is_empty() {
            return Err(unknown.join("; "));
        }
        let v = |name: &str| {
            self.fields
                .iter()
                .find(|f| f.name == name)
                .and_then(|f| f.value)
                .unwrap_or_default()
        };
        let o = NixlOffsets {
            version: "derived from the library",
            agent_data: v("agent_data"),
            data_name: v("data_name"),
            req_remote: v("req_remote"),
            req_op: v("req_op"),
            req_bytes: v("req_bytes"),
            req_descs: v("req_descs"),
            req_notif: v("req_notif"),
            req_has_notif: v("req_has_notif"),
            dlist_begin: v("dlist_begin"),
            desc_stride: v("desc_stride"),
            desc_len: v("desc_len"),
            req_status: v("req_status"),
            counts: self.counts,
            sites: None,
        };
        let (_, len) = o.req_window();
        if len > REQ_WINDOW {
            return Err(format!(
                "the request's fields span {len} bytes, more than the {REQ_WINDOW} the \
                 probes copy"
            ));
        }
        Ok(o)
    }

    /// What `kvscope agent nixl-inspect` prints: each field, its value and evidence.
    pub fn report(&self) -> String {
        let mut s = String::new();
        for f in &self.fields {
            match f.value {
                Some(v) => s.push_str(&format!(
                    "{:<14} {v:#x}  ({} instruction{})\n",
                    f.name,
                    f.evidence.len(),
                    if f.evidence.len() == 1 { "" } else { "s" }
                )),
                None => s.push_str(&format!(
                    "{:<14} unknown: {}\n",
                    f.name,
                    f.unknown_because.as_deref().unwrap_or("not found")
                )),
            }
            for e in &f.evidence {
                s.push_str(&format!("{:<14}   {e}\n", ""));
            }
        }
        if self.isa == Isa::X86_64 {
            self.report_sites(&mut s);
        } else {
            s.push_str(&format!(
                "\nno site is placed on an {} build: the probes read x86-64 registers\n",
                self.isa.name()
            ));
        }
        s.push_str(&format!(
            "\nreq_bytes and req_descs are read {}: {}\n",
            match self.counts {
                Counts::Always => "on every post".to_string(),
                Counts::WithTelemetry { data_flag } => format!(
                    "when the agent's telemetry is enabled (the byte at nixlAgentData+\
                     {data_flag:#x}); else the transfer's bytes are counted as unknown"
                ),
                Counts::Never => "never; every transfer's bytes are counted as unknown".into(),
            },
            self.counts_because
        ));
        s
    }

    /// Where the sites are (an x86-64 build's), or why each is not.
    fn report_sites(&self, s: &mut String) {
        match &self.telemetry_refused {
            Ok(site) => {
                s.push_str(&format!(
                    "\ngetXferTelemetry refuses agents without telemetry at {:#x}:\n",
                    site.address
                ));
                for e in &site.evidence {
                    s.push_str(&format!("{:<14}   {e}\n", ""));
                }
            }
            Err(why) => s.push_str(&format!(
                "\ngetXferTelemetry's refusals are not counted: {why}\n"
            )),
        }
        match &self.end_sites {
            Ok(sites) => {
                let list = |v: &[u64]| {
                    v.iter()
                        .map(|a| format!("{a:#x}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                s.push_str(&format!(
                    "\ngetXferStatus' completion sites (the request in {:?}): succeeded at {}; \
                     failed at {}; stale at {} (returns {}); releaseXferReq's in flight at {} \
                     (the request in {:?}):\n",
                    sites.request,
                    list(&sites.succeeded),
                    list(&sites.failed),
                    if sites.stale.is_empty() {
                        "none".to_string()
                    } else {
                        list(&sites.stale)
                    },
                    sites.stale_status,
                    list(&sites.released_in_flight),
                    sites.release_request
                ));
                for e in &sites.evidence {
                    s.push_str(&format!("{:<14}   {e}\n", ""));
                }
            }
            Err(why) => s.push_str(&format!(
                "\ngetXferStatus is probed on every poll and releaseXferReq on every release: \
                 the completion sites were not found: {why}\n"
            )),
        }
        for (name, sites) in [
            ("createXferReq", &self.create_sites),
            ("makeXferReq", &self.make_sites),
        ] {
            match sites {
                Ok(sites) => {
                    s.push_str(&format!(
                        "\n{name} fails at {} site{}:\n",
                        sites.failed.len(),
                        if sites.failed.len() == 1 { "" } else { "s" }
                    ));
                    for e in &sites.evidence {
                        s.push_str(&format!("{:<14}   {e}\n", ""));
                    }
                }
                Err(why) => s.push_str(&format!(
                    "\n{name} is probed at its entry and return: its failure sites were not \
                     found: {why}\n"
                )),
            }
        }
        match &self.post_site {
            Ok(site) => {
                s.push_str(&format!(
                    "\npostXferReq's status is final at {:#x} (in {:?}):\n",
                    site.at, site.status
                ));
                for e in &site.evidence {
                    s.push_str(&format!("{:<14}   {e}\n", ""));
                }
            }
            Err(why) => s.push_str(&format!(
                "\npostXferReq is probed at its return: no site holds its final status: {why}\n"
            )),
        }
    }
}

/// Derive every field from the methods `code` finds (None: the build does not export
/// it); `code_at` gives the bytes at a virtual address (a jump's target outside them).
/// `callee` names the function a direct call at an address goes to, where the library
/// says (a PLT stub's symbol).
pub fn derive<'a>(
    isa: Isa,
    code: &dyn Fn(&'static str) -> Option<MethodCode<'a>>,
    code_at: &dyn Fn(u64) -> Option<MethodCode<'a>>,
    callee: &dyn Fn(u64) -> Option<String>,
) -> Derivation {
    let runs: HashMap<&str, Option<Run>> = METHODS
        .iter()
        .map(|m| {
            let run = |c| match isa {
                Isa::X86_64 => Run::of(short_name(m), c),
                Isa::Aarch64 => aarch64::run(short_name(m), c),
            };
            (*m, code(m).map(run))
        })
        .collect();
    let run = |m: &'static str| -> Result<&Run, String> {
        runs.get(m)
            .and_then(Option::as_ref)
            .ok_or_else(|| format!("{} is not exported", short_name(m)))
    };
    let mut fields = Vec::new();
    let mut put = |name: &'static str, found: Result<Finding, String>| {
        fields.push(match found {
            Ok(f) => Field {
                name,
                value: Some(f.value),
                evidence: f.evidence,
                unknown_because: None,
            },
            Err(why) => Field {
                name,
                value: None,
                evidence: Vec::new(),
                unknown_because: Some(why),
            },
        })
    };

    put(
        "agent_data",
        agree(
            [TELEMETRY, POST, STATUS]
                .iter()
                .filter_map(|m| run(m).ok())
                .filter_map(|r| r.first_read(|l| l.field_of(0)))
                .map(|(step, off)| (off, vec![step.evidence.clone()]))
                .collect(),
            "no nixlAgent method reads `this`",
        ),
    );
    put("data_name", run(DATA_CTOR).and_then(data_name));
    let telemetry = run(TELEMETRY).and_then(telemetry);
    let post = run(POST).and_then(post);
    let status_stores = run(STATUS).map(|r| r.status_stores());
    // A field of a method's findings, or why the method gave none.
    fn of<T>(
        found: &Result<T, String>,
        field: impl Fn(&T) -> &Result<Finding, String>,
    ) -> Result<Finding, String> {
        found
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|t| field(t).clone())
    }
    put("req_remote", of(&post, |p| &p.remote));
    put("req_op", of(&post, |p| &p.op));
    put("req_bytes", of(&telemetry, |t| &t.bytes));
    put("req_descs", of(&telemetry, |t| &t.descs));
    put("req_notif", of(&post, |p| &p.notif));
    put("req_has_notif", of(&post, |p| &p.has_notif));
    let (list, stride, len) = match run(REGISTER).and_then(descriptor_sum) {
        Ok((b, s, l)) => (Ok(b), Ok(s), Ok(l)),
        Err(e) => (Err(e.clone()), Err(e.clone()), Err(e)),
    };
    put("dlist_begin", list);
    put("desc_stride", stride);
    put("desc_len", len);
    let mut status: Vec<(u64, Vec<String>)> =
        [of(&telemetry, |t| &t.status), of(&post, |p| &p.status)]
            .into_iter()
            .flatten()
            .map(|f| (f.value, f.evidence))
            .collect();
    if let Ok(stores) = &status_stores {
        status.extend(stores.iter().map(|(v, e)| (*v, vec![e.clone()])));
    }
    put(
        "req_status",
        agree(
            status,
            "neither getXferTelemetry, postXferReq nor getXferStatus names it",
        ),
    );
    let agent_data = fields
        .iter()
        .find(|f| f.name == "agent_data")
        .and_then(|f| f.value);
    let (counts, counts_because) = match (&telemetry, run(CREATE)) {
        (Ok(Telemetry { bytes: Ok(b), .. }), Ok(create)) => {
            counts_filled(create, b.value, agent_data)
        }
        (_, Err(why)) => (Counts::Never, why),
        (Err(why), _) => (Counts::Never, why.clone()),
        (
            Ok(Telemetry {
                bytes: Err(why), ..
            }),
            _,
        ) => (Counts::Never, why.clone()),
    };
    let req_status = fields
        .iter()
        .find(|f| f.name == "req_status")
        .and_then(|f| f.value);
    if isa == Isa::Aarch64 {
        // The sites are where uprobes go, and the probes read x86-64 registers.
        let x86_only = "placed on x86-64 builds only (the probes read x86-64 registers)";
        return Derivation {
            isa,
            fields,
            counts,
            counts_because,
            telemetry_refused: Err(x86_only.into()),
            end_sites: Err(x86_only.into()),
            post_site: Err(x86_only.into()),
            create_sites: Err(x86_only.into()),
            make_sites: Err(x86_only.into()),
        };
    }
    let telemetry_refused = run(TELEMETRY).and_then(|r| refused_site(r, agent_data, code_at));
    // The same flag gates getXferTelemetry: a second instruction naming it.
    let counts_because = match (&counts, &telemetry_refused) {
        (Counts::WithTelemetry { data_flag }, Ok(site)) if site.flag == Some(*data_flag) => {
            format!(
                "{counts_because}; the same flag gates `{}`",
                site.site.evidence[0]
            )
        }
        _ => counts_because,
    };
    let end_sites = match (code(STATUS), code(RELEASE), req_status) {
        (Some(status), Some(release), Some(at)) => {
            end_sites::end_sites(status, release, at, code_at, callee)
        }
        (None, ..) => Err("getXferStatus is not exported".into()),
        (_, None, _) => Err("releaseXferReq is not exported".into()),
        (.., None) => Err("the request's status offset is unknown".into()),
    };
    let post_site = match code(POST) {
        Some(post) => post_site::post_site(post, code_at, callee),
        None => Err("postXferReq is not exported".into()),
    };
    let create_sites = match code(CREATE) {
        Some(c) => creation_sites::creation_sites(Creator::Create, c, code_at, callee),
        None => Err("createXferReq is not exported".into()),
    };
    let make_sites = match (code(MAKE_SPAN), code(MAKE_BY_REFERENCE)) {
        (Some(c), _) => creation_sites::creation_sites(Creator::MakeSpan, c, code_at, callee),
        (None, Some(c)) => {
            creation_sites::creation_sites(Creator::MakeByReference, c, code_at, callee)
        }
        (None, None) => Err("makeXferReq is not exported".into()),
    };
    Derivation {
        isa,
        fields,
        counts,
        counts_because,
        telemetry_refused: telemetry_refused.map(|s| s.site),
        end_sites,
        post_site,
        create_sites,
        make_sites,
    }
}

struct Refused {
    site: RefusedSite,
    /// The byte of the agent's data the jump tested, when it was one byte.
    flag: Option<u64>,
}

/// `getXferTelemetry`'s first conditional jump on a field of the agent's data, taken
/// with `this` and the request still in `rdi` and `rsi`, to a block that returns
/// `NIXL_ERR_NO_TELEMETRY` (after a log call, before any other return or jump).
fn refused_site<'a>(
    run: &Run,
    agent_data: Option<u64>,
    code_at: &dyn Fn(u64) -> Option<MethodCode<'a>>,
) -> Result<Refused, String> {
    let (test, jump, flag) = run
        .steps
        .iter()
        .enumerate()
        .filter(|(_, s)| s.cond_target.is_some())
        .find_map(|(j, s)| {
            let (disp, size, test) = run.agent_data_test(j, agent_data)?;
            Some((test, s, (size == 1).then(|| offset(disp)).flatten()))
        })
        .ok_or("getXferTelemetry tests no field of the agent's data")?;
    let target = jump.cond_target.unwrap_or_default();
    if !jump.first_args_held {
        return Err(format!(
            "`{}`: the agent and request are no longer in rdi and rsi there",
            jump.evidence
        ));
    }
    let code = code_at(target)
        .ok_or_else(|| format!("`{}` jumps outside the library's code", jump.evidence))?;
    let mut decoder = Decoder::with_ip(64, code.bytes, code.address, DecoderOptions::NONE);
    let mut formatter = GasFormatter::new();
    formatter.options_mut().set_uppercase_hex(false);
    let mut ins = Instruction::default();
    for _ in 0..64 {
        if !decoder.can_decode() {
            break;
        }
        decoder.decode_out(&mut ins);
        let m = ins.mnemonic();
        if ins.is_invalid() || matches!(m, Mnemonic::Ret | Mnemonic::Jmp) {
            break;
        }
        if m == Mnemonic::Mov
            && ins.op_count() == 2
            && ins.op0_kind() == OpKind::Register
            && ins.op0_register() == Register::EAX
            && is_immediate(ins.op1_kind())
            && ins.immediate(1) as u32 as i32 == ERR_NO_TELEMETRY
        {
            let mut text = String::new();
            formatter.format(&ins, &mut text);
            return Ok(Refused {
                site: RefusedSite {
                    address: target,
                    evidence: vec![
                        test.evidence.clone(),
                        jump.evidence.clone(),
                        format!("{target:#x}+{:#x}: {text}", ins.ip() - target),
                    ],
                },
                flag,
            });
        }
    }
    Err(format!(
        "the path `{}` takes returns no NIXL_ERR_NO_TELEMETRY",
        jump.evidence
    ))
}

/// When `createXferReq` fills the byte count at `bytes`: on its straight path (always),
/// or on a path a conditional jump on a byte of the agent's data takes or skips — the
/// telemetry switch of builds before 1.4 (`mov (this),data; cmpb $0,F(data); je` over
/// the store, or `jne` to a block holding it) — or nowhere.
fn counts_filled(run: &Run, bytes: u64, agent_data: Option<u64>) -> (Counts, String) {
    // 8-byte stores, or 16-byte ones of the bytes and descriptors together (1.0).
    let stores: Vec<usize> = run
        .steps
        .iter()
        .enumerate()
        .filter(|(_, s)| {
            s.store.is_some_and(|(disp, size)| {
                size >= 8 && offset(disp).is_some_and(|d| d <= bytes && bytes < d + size as u64)
            })
        })
        .map(|(i, _)| i)
        .collect();
    if stores.is_empty() {
        return (
            Counts::Never,
            format!("createXferReq stores no byte count at the request's {bytes:#x}"),
        );
    }
    // The byte of the agent's data a jump's condition was read from, and its evidence.
    let flag_of = |jump: usize| -> Option<(u64, String)> {
        let (disp, size, test) = run.agent_data_test(jump, agent_data)?;
        (size == 1).then_some(())?;
        Some((offset(disp)?, test.evidence.clone()))
    };
    for &i in &stores {
        let ip = run.steps[i].ip;
        let block = run.steps[i.saturating_sub(8)].ip;
        let skips = (i.saturating_sub(8)..i)
            .rev()
            .find(|&j| run.steps[j].cond_target.is_some_and(|t| t > ip));
        // A jump from before to the few instructions that end in the store.
        let leads_to = || {
            run.steps[..i.saturating_sub(8)]
                .iter()
                .position(|s| s.cond_target.is_some_and(|t| block <= t && t <= ip))
                .filter(|&j| flag_of(j).is_some())
        };
        let Some(jump) = skips.or_else(leads_to) else {
            continue;
        };
        let gate = format!(
            "`{}` {} `{}`",
            run.steps[jump].evidence,
            if skips.is_some() { "skips" } else { "leads to" },
            run.steps[i].evidence
        );
        return match flag_of(jump) {
            Some((flag, read)) => (
                Counts::WithTelemetry { data_flag: flag },
                format!("createXferReq fills them only when `{read}` finds the flag set ({gate})"),
            ),
            None => (
                Counts::Never,
                format!(
                    "createXferReq fills them only on some paths ({gate}), on a condition \
                     that is not a flag of the agent's data"
                ),
            ),
        };
    }
    (
        Counts::Always,
        format!(
            "createXferReq fills them on its straight path (`{}`)",
            run.steps[stores[0]].evidence
        ),
    )
}

/// The GOT slot a PLT stub at `code` jumps through (`jmp *slot(%rip)`, after an
/// `endbr64` where the build has CET), or None when the code is not a stub.
pub(crate) fn plt_slot(code: MethodCode<'_>) -> Option<u64> {
    let mut decoder = Decoder::with_ip(64, code.bytes, code.address, DecoderOptions::NONE);
    for _ in 0..2 {
        let ins = decoder.decode();
        match ins.mnemonic() {
            Mnemonic::Endbr64 => continue,
            Mnemonic::Jmp if ins.op0_kind() == OpKind::Memory && ins.is_ip_rel_memory_operand() => {
                return Some(ins.ip_rel_memory_address())
            }
            _ => return None,
        }
    }
    None
}

/// The method's name as the evidence shows it.
fn short_name(prefix: &str) -> &'static str {
    match prefix {
        TELEMETRY => "getXferTelemetry",
        POST => "postXferReq",
        STATUS => "getXferStatus",
        REGISTER => "registerMem",
        CREATE => "createXferReq",
        _ => "nixlAgentData",
    }
}

/// A value and the instructions that named it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Finding {
    value: u64,
    evidence: Vec<String>,
}

/// One value all candidates agree on, with all their evidence; else why not.
fn agree(candidates: Vec<(u64, Vec<String>)>, none: &str) -> Result<Finding, String> {
    let mut values: Vec<u64> = candidates.iter().map(|c| c.0).collect();
    values.sort_unstable();
    values.dedup();
    match values.as_slice() {
        [] => Err(none.to_string()),
        [v] => Ok(Finding {
            value: *v,
            evidence: candidates.into_iter().flat_map(|c| c.1).collect(),
        }),
        many => Err(format!(
            "instructions disagree: {}",
            many.iter()
                .map(|v| {
                    let at: Vec<&str> = candidates
                        .iter()
                        .filter(|c| c.0 == *v)
                        .flat_map(|c| c.1.iter().map(String::as_str))
                        .collect();
                    format!("{v:#x} ({})", at.join(", "))
                })
                .collect::<Vec<_>>()
                .join(" against ")
        )),
    }
}

fn offset(v: i64) -> Option<u64> {
    u64::try_from(v).ok()
}

fn data_name(run: &Run) -> Result<Finding, String> {
    // The name's string: its pointer set to its inline buffer 16 bytes on.
    let (step, x) = run
        .steps
        .iter()
        .find_map(|s| {
            s.seen.iter().find_map(|seen| match seen {
                Seen::Write {
                    at: Loc::Field { arg: 0, off },
                    size: 8,
                    value: Value::Sym(Sym::Addr { arg: 0, off: to }),
                } if *to == off.wrapping_add(16) => Some((s, *off)),
                _ => None,
            })
        })
        .ok_or("nixlAgentData's constructor builds no string in place")?;
    let mut evidence = vec![step.evidence.clone()];
    // Confirmed by its length, copied from the argument's.
    evidence.extend(run.steps_where(|seen| {
        matches!(seen, Seen::Write {
            at: Loc::Field { arg: 0, off },
            size: 8,
            value: Value::Sym(Sym::Read { arg: 1, off: 8 }),
        } if *off == x.wrapping_add(8))
    }));
    Ok(Finding {
        value: offset(x).ok_or("a negative offset")?,
        evidence,
    })
}

struct Telemetry {
    status: Result<Finding, String>,
    bytes: Result<Finding, String>,
    descs: Result<Finding, String>,
}

/// Offsets in `nixlXferTelemetry` (five 8-byte fields).
const TELEMETRY_BYTES: i64 = 0x18;
const TELEMETRY_DESCS: i64 = 0x20;

fn telemetry(run: &Run) -> Result<Telemetry, String> {
    // (telemetry offset, request offset, length, evidence of the read and the write)
    let mut copies: Vec<(i64, i64, i64, Vec<String>)> = Vec::new();
    for s in &run.steps {
        for seen in &s.seen {
            if let Seen::Write {
                at: Loc::Field { arg: 2, off: d },
                size,
                value: Value::Sym(Sym::Read { arg: 1, off: from }),
            } = seen
            {
                let read = run.origin_of(s, *from);
                copies.push((
                    *d,
                    *from,
                    *size as i64,
                    read.into_iter().chain([s.evidence.clone()]).collect(),
                ));
            }
        }
    }
    if copies.is_empty() {
        return Err("getXferTelemetry copies nothing of the request".into());
    }
    let field = |at: i64| -> Result<Finding, String> {
        let c = copies
            .iter()
            .find(|c| c.0 <= at && at.saturating_add(8) <= c.0.saturating_add(c.2))
            .ok_or_else(|| format!("getXferTelemetry copies nothing to telemetry+{at:#x}"))?;
        Ok(Finding {
            value: offset(c.1.wrapping_add(at - c.0)).ok_or("a negative offset")?,
            evidence: c.3.clone(),
        })
    };
    let status = run
        .steps
        .iter()
        .find_map(|s| {
            s.seen.iter().find_map(|seen| match seen {
                Seen::Read {
                    at: Loc::Field { arg: 1, off },
                    size: 4,
                    ..
                } => Some((s, *off)),
                _ => None,
            })
        })
        .and_then(|(s, off)| {
            Some(Finding {
                value: offset(off)?,
                evidence: vec![s.evidence.clone()],
            })
        })
        .ok_or_else(|| "getXferTelemetry reads no status".to_string());
    Ok(Telemetry {
        status,
        bytes: field(TELEMETRY_BYTES),
        descs: field(TELEMETRY_DESCS),
    })
}

struct Post {
    op: Result<Finding, String>,
    remote: Result<Finding, String>,
    status: Result<Finding, String>,
    notif: Result<Finding, String>,
    has_notif: Result<Finding, String>,
}

/// What a call may overwrite (System V x86-64).
const CALLER_SAVED: [Register; 9] = [
    Register::RAX,
    Register::RCX,
    Register::RDX,
    Register::RSI,
    Register::RDI,
    Register::R8,
    Register::R9,
    Register::R10,
    Register::R11,
];

/// Argument registers in order.
const ARGS: [Register; 6] = [
    Register::RDI,
    Register::RSI,
    Register::RDX,
    Register::RCX,
    Register::R8,
    Register::R9,
];

fn post(run: &Run) -> Result<Post, String> {
    // The backend's postXfer(op&, local, remote, remoteAgent&, handle&, opt): a virtual
    // call given the request's fields in rsi, r8 and r9.
    let mut calls = Vec::new();
    for (i, s) in run.steps.iter().enumerate() {
        for seen in &s.seen {
            if let Seen::Call {
                indirect: true,
                args,
            } = seen
            {
                if let (
                    Some(Sym::Addr { arg: 1, off: op }),
                    Some(Sym::Addr {
                        arg: 1,
                        off: remote,
                    }),
                    Some(Sym::Addr { arg: 1, .. }),
                ) = (args[1], args[4], args[5])
                {
                    calls.push((i, op, remote));
                }
            }
        }
    }
    let Some(&(at, _, _)) = calls.first() else {
        let none = "postXferReq makes no backend call given the request's fields".to_string();
        return Ok(Post {
            op: Err(none.clone()),
            remote: Err(none.clone()),
            status: Err(none.clone()),
            notif: Err(none.clone()),
            has_notif: Err(none),
        });
    };
    let call_evidence = |reg: usize| -> Vec<String> {
        calls
            .iter()
            .flat_map(|(i, _, _)| {
                let s = &run.steps[*i];
                s.arg_origins[reg]
                    .iter()
                    .map(|o| run.steps[*o].evidence.clone())
                    .chain([s.evidence.clone()])
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let op = agree(
        calls
            .iter()
            .filter_map(|c| offset(c.1))
            .map(|v| (v, Vec::new()))
            .collect(),
        "no op",
    )
    .map(|f| Finding {
        evidence: call_evidence(1),
        ..f
    });
    let remote = agree(
        calls
            .iter()
            .filter_map(|c| offset(c.2))
            .map(|v| (v, Vec::new()))
            .collect(),
        "no remote agent",
    )
    .map(|f| Finding {
        evidence: call_evidence(4),
        ..f
    });
    // The answer, stored to the request's status after the call.
    let status = run.steps[at..]
        .iter()
        .find_map(|s| {
            s.seen.iter().find_map(|seen| match seen {
                Seen::Write {
                    at: Loc::Field { arg: 1, off },
                    size: 4,
                    value: Value::Untracked { returned: true },
                } => Some((s, *off)),
                _ => None,
            })
        })
        .and_then(|(s, off)| {
            Some(Finding {
                value: offset(off)?,
                evidence: vec![s.evidence.clone()],
            })
        })
        .ok_or_else(|| "postXferReq stores no backend answer in the request".to_string());
    // hasNotif: the request byte set to 1; the notification: the string the last call
    // before was given to write.
    let sets: Vec<(usize, i64)> = run
        .steps
        .iter()
        .enumerate()
        .flat_map(|(i, s)| {
            s.seen.iter().filter_map(move |seen| match seen {
                Seen::Write {
                    at: Loc::Field { arg: 1, off },
                    size: 1,
                    value: Value::Imm(1),
                } => Some((i, *off)),
                _ => None,
            })
        })
        .collect();
    let has_notif = agree(
        sets.iter()
            .filter_map(|(i, off)| Some((offset(*off)?, vec![run.steps[*i].evidence.clone()])))
            .collect(),
        "postXferReq sets no flag of the request",
    )
    .map(|mut f| {
        // Confirmed where the flag is tested or cleared.
        f.evidence.extend(run.steps_where(|seen| match seen {
            Seen::Read {
                at: Loc::Field { arg: 1, off },
                size: 1,
            }
            | Seen::Write {
                at: Loc::Field { arg: 1, off },
                size: 1,
                value: Value::Imm(0),
            } => offset(*off) == Some(f.value),
            _ => false,
        }));
        f
    });
    let notif = has_notif
        .as_ref()
        .map_err(|_| "no hasNotif to find it by".to_string())
        .and_then(|_| {
            agree(
                sets.iter()
                    .filter_map(|(i, _)| {
                        run.steps[..*i].iter().rev().take(16).find_map(|s| {
                            s.seen.iter().find_map(|seen| match seen {
                                Seen::Call {
                                    indirect: false,
                                    args,
                                } => match args[0] {
                                    Some(Sym::Addr { arg: 1, off }) => {
                                        Some((offset(off)?, run.with_arguments(s)))
                                    }
                                    _ => None,
                                },
                                _ => None,
                            })
                        })
                    })
                    .collect(),
                "no string of the request is written before hasNotif is set",
            )
        })
        .map(|mut f| {
            // Confirmed where the notification is copied out of the request.
            f.evidence.extend(run.steps_where(|seen| match seen {
                Seen::Call {
                    indirect: false,
                    args,
                } => matches!(args[1], Some(Sym::Addr { arg: 1, off }) if offset(off) == Some(f.value)),
                _ => false,
            }));
            f
        });
    Ok(Post {
        op,
        remote,
        status,
        notif,
        has_notif,
    })
}

/// The descriptor list's begin, the descriptors' stride and the length's offset: the
/// loop `add D(p),acc; add $S,p` over `p = list.begin`.
fn descriptor_sum(run: &Run) -> Result<(Finding, Finding, Finding), String> {
    for (i, s) in run.steps.iter().enumerate() {
        for seen in &s.seen {
            let Seen::Sum {
                list_at,
                len_at,
                pointer,
            } = seen
            else {
                continue;
            };
            let Some((j, stride)) =
                run.steps[i + 1..]
                    .iter()
                    .take(4)
                    .enumerate()
                    .find_map(|(j, t)| {
                        t.seen.iter().find_map(|seen| match seen {
                            Seen::Advance { reg, by } if reg == pointer => Some((i + 1 + j, *by)),
                            _ => None,
                        })
                    })
            else {
                continue;
            };
            let begin_ev = run.origin_of(s, *list_at);
            let mut list_ev: Vec<String> = begin_ev;
            // Confirmed by the loop's end: the vector's end pointer, read 8 bytes on.
            for e in run.steps_where(|seen| {
                matches!(seen, Seen::Read { at: Loc::Field { arg: 1, off }, size: 8 }
                    if *off == list_at.wrapping_add(8))
            }) {
                // (One instruction reads both where a pair is loaded at once.)
                if !list_ev.contains(&e) {
                    list_ev.push(e);
                }
            }
            let (Some(b), Some(st), Some(l)) = (offset(*list_at), offset(stride), offset(*len_at))
            else {
                continue;
            };
            return Ok((
                Finding {
                    value: b,
                    evidence: list_ev,
                },
                Finding {
                    value: st,
                    evidence: vec![run.steps[j].evidence.clone()],
                },
                Finding {
                    value: l,
                    evidence: vec![s.evidence.clone()],
                },
            ));
        }
    }
    Err("registerMem sums no descriptor lengths (a build without telemetry?)".into())
}

/// A value a register or frame slot holds, in terms of the method's arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sym {
    /// The address `argument + off`.
    Addr { arg: u8, off: i64 },
    /// The 8 bytes read at `argument + off`.
    Read { arg: u8, off: i64 },
}

/// Where a memory operand points.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loc {
    /// `argument + off`.
    Field { arg: u8, off: i64 },
    /// `*(argument + off) + disp`.
    Deref { arg: u8, off: i64, disp: i64 },
    /// Anything else (the stack, globals, unknown pointers).
    Other,
}

impl Loc {
    fn field_of(&self, arg: u8) -> Option<i64> {
        match self {
            Loc::Field { arg: a, off } if *a == arg => Some(*off),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Value {
    Sym(Sym),
    Imm(u64),
    /// A register whose content is not tracked; `returned` when it is the 4-byte
    /// return-value register (`eax`, `w0`): a call's answer.
    Untracked {
        returned: bool,
    },
    Unknown,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Seen {
    Read {
        at: Loc,
        size: usize,
    },
    Write {
        at: Loc,
        size: usize,
        value: Value,
    },
    Call {
        indirect: bool,
        args: [Option<Sym>; 6],
    },
    /// `add D(p),acc` with `p` read from the argument at `list_at`.
    Sum {
        list_at: i64,
        len_at: i64,
        pointer: usize,
    },
    /// `add $by,reg`.
    Advance {
        reg: usize,
        by: i64,
    },
}

struct Step {
    ip: u64,
    evidence: String,
    /// A store's displacement and size, through a register other than the stack's,
    /// the frame's or the instruction pointer.
    store: Option<(i64, usize)>,
    /// A conditional jump's target.
    cond_target: Option<u64>,
    seen: Vec<Seen>,
    /// For a call: the steps that set each argument register.
    arg_origins: [Option<usize>; 6],
    /// `rdi` and `rsi` still hold the first two arguments before this instruction.
    first_args_held: bool,
}

/// One method run symbolically.
struct Run {
    steps: Vec<Step>,
}

#[derive(Default, Clone)]
struct State {
    gpr: [Option<(Sym, usize)>; 16],
    xmm: [Option<(Sym, usize)>; 32],
    slots: HashMap<(Register, i64), (Sym, usize)>,
}

fn gpr(r: Register) -> Option<usize> {
    let f = r.full_register();
    f.is_gpr64().then(|| f.number())
}

/// Every register a site may read: the callee-saved ones first (they hold their values
/// across calls), then the others (an argument still in place before any call).
const SITE_REGS: [(Register, SiteReg); 15] = [
    (Register::RBX, SiteReg::Rbx),
    (Register::RBP, SiteReg::Rbp),
    (Register::R12, SiteReg::R12),
    (Register::R13, SiteReg::R13),
    (Register::R14, SiteReg::R14),
    (Register::R15, SiteReg::R15),
    (Register::RAX, SiteReg::Rax),
    (Register::RCX, SiteReg::Rcx),
    (Register::RDX, SiteReg::Rdx),
    (Register::RSI, SiteReg::Rsi),
    (Register::RDI, SiteReg::Rdi),
    (Register::R8, SiteReg::R8),
    (Register::R9, SiteReg::R9),
    (Register::R10, SiteReg::R10),
    (Register::R11, SiteReg::R11),
];

/// How many of [`SITE_REGS`] are callee-saved.
const CALLEE_SAVED_SITE_REGS: usize = 6;

/// The site register of general-purpose register `g`, callee-saved or not.
fn any_site_reg(g: usize) -> Option<SiteReg> {
    SITE_REGS
        .iter()
        .find(|(reg, _)| gpr(*reg) == Some(g))
        .map(|(_, s)| *s)
}

/// The site register of general-purpose register `g`, where it is a callee-saved one.
fn site_reg(g: usize) -> Option<SiteReg> {
    SITE_REGS[..CALLEE_SAVED_SITE_REGS]
        .iter()
        .find(|(reg, _)| gpr(*reg) == Some(g))
        .map(|(_, s)| *s)
}

/// The general-purpose register number of a site register.
fn site_gpr(r: SiteReg) -> Option<usize> {
    SITE_REGS
        .iter()
        .find(|(_, s)| *s == r)
        .and_then(|(reg, _)| gpr(*reg))
}

impl Run {
    fn of(name: &str, code: MethodCode<'_>) -> Run {
        let mut decoder = Decoder::with_ip(64, code.bytes, code.address, DecoderOptions::NONE);
        let mut formatter = GasFormatter::new();
        formatter.options_mut().set_uppercase_hex(false);
        let mut info = InstructionInfoFactory::new();
        let mut state = State::default();
        for (i, r) in ARGS.iter().enumerate() {
            if let Some(g) = gpr(*r) {
                state.gpr[g] = Some((
                    Sym::Addr {
                        arg: i as u8,
                        off: 0,
                    },
                    usize::MAX,
                ));
            }
        }
        let mut steps = Vec::new();
        let mut ins = Instruction::default();
        while decoder.can_decode() {
            decoder.decode_out(&mut ins);
            if ins.is_invalid() {
                break;
            }
            let mut text = String::new();
            formatter.format(&ins, &mut text);
            let evidence = format!("{name}+{:#x}: {text}", ins.ip().wrapping_sub(code.address));
            let index = steps.len();
            let held = |r: Register, arg: u8| {
                gpr(r).and_then(|g| state.gpr[g]).map(|(s, _)| s) == Some(Sym::Addr { arg, off: 0 })
            };
            let first_args_held = held(Register::RDI, 0) && held(Register::RSI, 1);
            let (seen, arg_origins) = step(&mut state, &ins, index, &mut info);
            let store = (matches!(
                ins.mnemonic(),
                Mnemonic::Mov
                    | Mnemonic::Movups
                    | Mnemonic::Movdqu
                    | Mnemonic::Movaps
                    | Mnemonic::Movdqa
            ) && ins.op_count() == 2
                && ins.op0_kind() == OpKind::Memory
                && ins.memory_index() == Register::None
                && !matches!(
                    ins.memory_base(),
                    Register::RSP | Register::RBP | Register::RIP
                ))
            .then(|| (ins.memory_displacement64() as i64, ins.memory_size().size()));
            let cond_target = ins.is_jcc_short_or_near().then(|| ins.near_branch_target());
            steps.push(Step {
                ip: ins.ip(),
                store,
                cond_target,
                evidence,
                seen,
                arg_origins,
                first_args_held,
            });
            // A method ends at its last ret or jump out; what follows is padding or the
            // next function, which the symbol's size already excludes.
        }
        Run { steps }
    }

    /// The first read of the memory `pick` accepts, and the offset it gives.
    fn first_read(&self, pick: impl Fn(&Loc) -> Option<i64>) -> Option<(&Step, u64)> {
        self.steps.iter().find_map(|s| {
            s.seen.iter().find_map(|seen| match seen {
                Seen::Read { at, size: 8 } => pick(at).and_then(offset).map(|o| (s, o)),
                _ => None,
            })
        })
    }

    /// The field of the agent's data (`*(this + agent_data) + disp`) that one of the two
    /// instructions before the conditional jump at `jump` reads: (disp, size, that step).
    fn agent_data_test(&self, jump: usize, agent_data: Option<u64>) -> Option<(i64, usize, &Step)> {
        self.steps[jump.saturating_sub(2)..jump]
            .iter()
            .rev()
            .find_map(|s| {
                s.seen.iter().find_map(|seen| match seen {
                    Seen::Read {
                        at: Loc::Deref { arg: 0, off, disp },
                        size,
                    } if offset(*off) == agent_data => Some((*disp, *size, s)),
                    _ => None,
                })
            })
    }

    /// The step that read argument 1's field `off`, before `s` (its evidence).
    fn origin_of(&self, s: &Step, off: i64) -> Vec<String> {
        let until = self
            .steps
            .iter()
            .position(|t| std::ptr::eq(t, s))
            .unwrap_or(0);
        self.steps[..until]
            .iter()
            .rev()
            .find(|t| {
                t.seen
                    .iter()
                    .any(|seen| matches!(seen, Seen::Read { at: Loc::Field { arg: 1, off: o }, .. } if *o == off))
            })
            .map(|t| vec![t.evidence.clone()])
            .unwrap_or_default()
    }

    /// The evidence of every step that saw something `pick` accepts.
    fn steps_where(&self, pick: impl Fn(&Seen) -> bool) -> Vec<String> {
        self.steps
            .iter()
            .filter(|s| s.seen.iter().any(&pick))
            .flat_map(|s| self.with_arguments(s))
            .collect()
    }

    /// A step's evidence, after that of the steps that set a call's first two
    /// arguments.
    fn with_arguments(&self, s: &Step) -> Vec<String> {
        s.arg_origins[..2]
            .iter()
            .flatten()
            .map(|o| self.steps[*o].evidence.clone())
            .chain([s.evidence.clone()])
            .collect()
    }

    /// Every 4-byte store to a request field (`getXferStatus`'s status).
    fn status_stores(&self) -> Vec<(u64, String)> {
        self.steps
            .iter()
            .flat_map(|s| {
                s.seen.iter().filter_map(move |seen| match seen {
                    Seen::Write {
                        at: Loc::Field { arg: 1, off },
                        size: 4,
                        value: Value::Untracked { .. },
                    } => Some((offset(*off)?, s.evidence.clone())),
                    _ => None,
                })
            })
            .collect()
    }
}

/// The memory operand of `ins`, where it points.
fn location(state: &State, ins: &Instruction) -> (Loc, Option<(Register, i64)>) {
    if ins.memory_index() != Register::None {
        return (Loc::Other, None);
    }
    let base = ins.memory_base();
    let disp = ins.memory_displacement64() as i64;
    if base == Register::RSP || base == Register::RBP {
        return (Loc::Other, Some((base, disp)));
    }
    let held = gpr(base).and_then(|g| state.gpr[g]).map(|(s, _)| s);
    let loc = match held {
        Some(Sym::Addr { arg, off }) => Loc::Field {
            arg,
            off: off.wrapping_add(disp),
        },
        Some(Sym::Read { arg, off }) => Loc::Deref { arg, off, disp },
        None => Loc::Other,
    };
    (loc, None)
}

fn memory_operand(ins: &Instruction) -> Option<usize> {
    (0..ins.op_count())
        .find(|i| ins.op_kind(*i) == OpKind::Memory)
        .map(|i| i as usize)
}

fn is_immediate(kind: OpKind) -> bool {
    matches!(
        kind,
        OpKind::Immediate8
            | OpKind::Immediate16
            | OpKind::Immediate32
            | OpKind::Immediate64
            | OpKind::Immediate8to16
            | OpKind::Immediate8to32
            | OpKind::Immediate8to64
            | OpKind::Immediate32to64
    )
}

/// Run one instruction: what it reads, writes and calls, then the state after it.
fn step(
    state: &mut State,
    ins: &Instruction,
    index: usize,
    info: &mut InstructionInfoFactory,
) -> (Vec<Seen>, [Option<usize>; 6]) {
    let mut seen = Vec::new();
    let mut arg_origins = [None; 6];
    let mem = memory_operand(ins);
    let (loc, slot) = mem.map_or((Loc::Other, None), |_| location(state, ins));
    let size = ins.memory_size().size();
    let m = ins.mnemonic();
    let reg0 =
        (ins.op_count() > 0 && ins.op_kind(0) == OpKind::Register).then(|| ins.op0_register());
    let mut set: Option<(Register, Option<Sym>)> = None;
    let moves = matches!(
        m,
        Mnemonic::Mov
            | Mnemonic::Movdqu
            | Mnemonic::Movdqa
            | Mnemonic::Movups
            | Mnemonic::Movaps
            | Mnemonic::Movq
            | Mnemonic::Vmovdqu
            | Mnemonic::Vmovups
    );
    match (m, mem) {
        (Mnemonic::Call, _) => {
            let indirect = matches!(ins.op0_kind(), OpKind::Memory | OpKind::Register);
            let mut args = [None; 6];
            for (i, r) in ARGS.iter().enumerate() {
                if let Some(g) = gpr(*r) {
                    args[i] = state.gpr[g].map(|(s, _)| s);
                    arg_origins[i] = state.gpr[g].map(|(_, o)| o).filter(|o| *o != usize::MAX);
                }
            }
            seen.push(Seen::Call { indirect, args });
            for r in CALLER_SAVED {
                if let Some(g) = gpr(r) {
                    state.gpr[g] = None;
                }
            }
            state.xmm = [None; 32];
            return (seen, arg_origins);
        }
        // An epilogue restores a callee-saved register the code after it (another
        // block of the same body, reached by a jump) still uses in its body role.
        (Mnemonic::Pop, _) => return (seen, arg_origins),
        (Mnemonic::Lea, Some(_)) => {
            let r = ins.op0_register();
            let sym = match loc {
                Loc::Field { arg, off } => Some(Sym::Addr { arg, off }),
                _ => None,
            };
            set = Some((r, sym));
        }
        (_, Some(1)) if moves && reg0.is_some() => {
            // A load.
            seen.push(Seen::Read { at: loc, size });
            let r = ins.op0_register();
            let sym = if let Some(key) = slot {
                state.slots.get(&key).map(|(s, _)| *s)
            } else {
                match loc {
                    Loc::Field { arg, off } if size == 8 || size == 16 => {
                        Some(Sym::Read { arg, off })
                    }
                    _ => None,
                }
            };
            set = Some((r, sym.filter(|_| size == 8 || r.is_xmm())));
        }
        (_, Some(0)) if moves => {
            // A store.
            let kind = ins.op1_kind();
            let value = if kind == OpKind::Register {
                let r = ins.op1_register();
                let held = if r.is_xmm() {
                    state.xmm.get(r.number()).copied().flatten()
                } else if r.size() == 8 {
                    gpr(r).and_then(|g| state.gpr[g])
                } else {
                    None
                };
                match held {
                    Some((s, _)) => Value::Sym(s),
                    None => Value::Untracked {
                        returned: r == Register::EAX,
                    },
                }
            } else if is_immediate(kind) {
                Value::Imm(ins.immediate(1))
            } else {
                Value::Unknown
            };
            if let Some(key) = slot {
                match value {
                    Value::Sym(s) if size == 8 => {
                        state.slots.insert(key, (s, index));
                    }
                    _ => {
                        state.slots.remove(&key);
                    }
                }
            }
            seen.push(Seen::Write {
                at: loc,
                size,
                value,
            });
            return (seen, arg_origins);
        }
        (Mnemonic::Mov, None) if reg0.is_some() && ins.op1_kind() == OpKind::Register => {
            let (r, from) = (ins.op0_register(), ins.op1_register());
            let held = (r.size() == 8 && from.size() == 8)
                .then(|| gpr(from).and_then(|g| state.gpr[g]).map(|(s, _)| s))
                .flatten();
            set = Some((r, held));
        }
        (Mnemonic::Add | Mnemonic::Sub, None) if reg0.is_some() && is_immediate(ins.op1_kind()) => {
            let r = ins.op0_register();
            let by = ins.immediate(1) as i64;
            let by = if m == Mnemonic::Sub {
                by.wrapping_neg()
            } else {
                by
            };
            if let Some(g) = gpr(r).filter(|_| r.size() == 8) {
                seen.push(Seen::Advance { reg: g, by });
                let held = state.gpr[g].and_then(|(s, _)| match s {
                    Sym::Addr { arg, off } => Some(Sym::Addr {
                        arg,
                        off: off.wrapping_add(by),
                    }),
                    Sym::Read { .. } => None,
                });
                set = Some((r, held));
            }
        }
        (Mnemonic::Add, Some(1)) => {
            seen.push(Seen::Read { at: loc, size });
            if let (Loc::Deref { arg: 1, off, disp }, Some(g)) = (loc, gpr(ins.memory_base())) {
                if size == 8 {
                    seen.push(Seen::Sum {
                        list_at: off,
                        len_at: disp,
                        pointer: g,
                    });
                }
            }
        }
        (_, Some(_)) => {
            seen.push(Seen::Read { at: loc, size });
        }
        _ => {}
    }
    // Whatever else the instruction writes is no longer tracked.
    for used in info.info(ins).used_registers() {
        if matches!(
            used.access(),
            OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite
        ) {
            let r = used.register();
            if set.is_some_and(|(s, _)| s.full_register() == r.full_register()) {
                continue;
            }
            forget(state, r);
        }
    }
    if let Some((r, sym)) = set {
        forget(state, r);
        let held = sym.map(|s| (s, index));
        if r.is_xmm() {
            if let Some(x) = state.xmm.get_mut(r.number()) {
                *x = held;
            }
        } else if let Some(g) = gpr(r) {
            state.gpr[g] = held.filter(|_| r.size() == 8);
        }
    }
    (seen, arg_origins)
}

fn forget(state: &mut State, r: Register) {
    if r.is_xmm() || r.is_ymm() {
        if let Some(x) = state.xmm.get_mut(r.number()) {
            *x = None;
        }
    } else if let Some(g) = gpr(r) {
        state.gpr[g] = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_bytes_give_a_derivation_never_a_panic() {
        // A library on a node can hold anything: random code in every method.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for round in 0..200usize {
            let bytes: Vec<u8> = (0..(round * 37) % 4096)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let code = MethodCode {
                address: 0x1000,
                bytes: &bytes,
            };
            for isa in [Isa::X86_64, Isa::Aarch64] {
                let d = derive(isa, &|_| Some(code), &|_| Some(code), &|_| None);
                assert_eq!(d.fields.len(), 12);
                let _ = d.offsets();
                assert!(!d.report().is_empty());
            }
        }
        // No method at all: every field unknown, each with its reason.
        let d = derive(Isa::X86_64, &|_| None, &|_| None, &|_| None);
        let why = d.offsets().unwrap_err();
        assert!(why.contains("not exported"), "{why}");
        assert!(d.fields.iter().all(|f| f.unknown_because.is_some()));
    }

    #[test]
    fn method_names_are_shortened_for_evidence() {
        assert_eq!(short_name(TELEMETRY), "getXferTelemetry");
        assert_eq!(short_name(REGISTER), "registerMem");
        assert_eq!(short_name(DATA_CTOR), "nixlAgentData");
    }
}
