//! Where a transfer's end is seen, read from the instructions of `getXferStatus` and
//! `releaseXferReq`, so that a build no table holds sees its transfers end without a
//! probe on every poll or release.
//!
//! Every release from 1.0 to 1.5 has the same shape: the method reads the request's
//! status and, only while it is in progress (`cmp $1`), finds the remote agent's
//! section, asks the backend (an indirect call) and stores its answer in the request.
//! The paths are walked from the method's first instruction, following jumps into its
//! cold part, knowing at each instruction which registers hold the request and the
//! status, and what the status can still be (negative, zero, in progress, above) after
//! the conditional jumps taken on it:
//! - **succeeded**: the first instruction a path reaches once the stored answer can only
//!   be zero; **failed**: once it can only be negative. A path that returns while the
//!   answer can still be zero (or negative) ends transfers no site sees: then there are
//!   no sites (1.0–1.3 merge a success with an in-progress answer when the agent's
//!   telemetry is off).
//! - **stale**: where a path leaves the in-progress branch for a return without asking
//!   the backend (the remote agent's section gone or replaced), and the constant status
//!   every such return gives.
//!
//! - **released in flight**: `releaseXferReq` compares the request's status with in
//!   progress (`cmpl $1`) before it asks the backend again; the path where it is.
//!
//! Each site then moves forward to the first jump of its straight run (x86 uprobes
//! emulate jumps: one trap, no single-step), unless another path enters the run or the
//! request's register changes on the way.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use iced_x86::{
    ConditionCode, FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpAccess, OpKind,
    Register,
};

use super::listing::Listing;
use super::{gpr, is_immediate, site_reg, MethodCode, CALLER_SAVED};
use crate::nixl::offsets::SiteReg;

/// Where transfers end, as virtual addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndSites {
    /// Run once the backend has answered that the transfer is done.
    pub succeeded: Vec<u64>,
    /// Run once it has answered that the transfer failed.
    pub failed: Vec<u64>,
    /// Run when the remote agent's metadata went away while the transfer was in
    /// progress: the method returns `stale_status` without storing it.
    pub stale: Vec<u64>,
    pub stale_status: i32,
    /// The callee-saved register holding the request at every `getXferStatus` site.
    pub request: SiteReg,
    /// Run when `releaseXferReq` finds its transfer still in progress.
    pub released_in_flight: Vec<u64>,
    /// The callee-saved register holding the request there.
    pub release_request: SiteReg,
    /// The instructions that placed each site.
    pub evidence: Vec<String>,
}

/// Status values a path may still hold, as bits.
const NEG: u8 = 1;
const ZERO: u8 = 2;
const IN_PROG: u8 = 4;
const ABOVE: u8 = 8;
const ANY: u8 = NEG | ZERO | IN_PROG | ABOVE;

/// Instructions walked in all, over every path: a bound for unexpected code.
const MAX_STEPS: usize = 20_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Phase {
    /// Before the status was found in progress.
    Before,
    /// On the in-progress branch, before the backend's answer is stored.
    Checking,
    /// After the answer is stored.
    Answered,
}

/// What the flags were last set from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Flags {
    Other,
    /// `test s,s` or `cmp $0,s` of a status register.
    Status,
    /// `cmp $1,s` of one.
    InProgress,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct PathState {
    phase: Phase,
    /// GPR numbers holding the request's address.
    request: u16,
    /// GPR numbers whose low 32 bits hold the status.
    status: u16,
    flags: Flags,
    can_be: u8,
    /// Constants in registers (for the stale path's returned status).
    constants: [Option<i32>; 16],
}

impl PathState {
    /// Register `g` was overwritten: it holds none of what the path tracks.
    fn forget(&mut self, g: usize) {
        self.request &= !(1 << g);
        self.status &= !(1 << g);
        self.constants[g] = None;
    }
}

/// What a conditional jump on the status leaves possible when taken (`true`) or not.
fn refine(cc: ConditionCode, flags: Flags, taken: bool) -> Option<u8> {
    let when_taken = match (flags, cc) {
        (Flags::Status, ConditionCode::e) => ZERO,
        (Flags::Status, ConditionCode::ne) => NEG | IN_PROG | ABOVE,
        (Flags::Status, ConditionCode::s | ConditionCode::l) => NEG,
        (Flags::Status, ConditionCode::ns | ConditionCode::ge) => ZERO | IN_PROG | ABOVE,
        (Flags::Status, ConditionCode::g) => IN_PROG | ABOVE,
        (Flags::Status, ConditionCode::le) => NEG | ZERO,
        (Flags::InProgress, ConditionCode::e) => IN_PROG,
        (Flags::InProgress, ConditionCode::ne) => NEG | ZERO | ABOVE,
        (Flags::InProgress, ConditionCode::le) => NEG | ZERO | IN_PROG,
        (Flags::InProgress, ConditionCode::g) => ABOVE,
        _ => return None,
    };
    Some(if taken { when_taken } else { ANY & !when_taken })
}

/// A site found on a path: its kind, address, the request's registers there, and the
/// jump that placed it.
struct Found {
    kind: Kind,
    at: u64,
    request: u16,
    jump: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Succeeded,
    Failed,
    Stale,
    Released,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Succeeded => "succeeded",
            Kind::Failed => "failed",
            Kind::Stale => "stale",
            Kind::Released => "released in flight",
        }
    }
}

/// Which method a walk reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Method {
    Status,
    Release,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::Status => "getXferStatus",
            Method::Release => "releaseXferReq",
        }
    }
}

struct Walk<'a, 'c> {
    which: Method,
    code: Listing<'a, 'c>,
    callee: &'c dyn Fn(u64) -> Option<String>,
    req_status: u64,
    info: InstructionInfoFactory,
    /// Every jump target seen (an instruction another path may enter at).
    targets: BTreeMap<u64, BTreeSet<u64>>,
    found: Vec<Found>,
    /// On the in-progress branch: every edge walked, and where the answer is stored.
    edges: BTreeSet<(u64, u64)>,
    stored_at: BTreeSet<u64>,
    request_at: HashMap<u64, u16>,
    /// What each return on the in-progress branch gives (None: not a constant).
    stale_returns: Vec<(u64, Option<i32>)>,
    /// Returns where a transfer's end goes unseen.
    unseen: Vec<String>,
    in_progress_check: Option<u64>,
    steps: usize,
}

impl Walk<'_, '_> {
    /// Walk every path from the method's entry.
    fn run(&mut self) {
        let mut start = PathState {
            phase: Phase::Before,
            request: 0,
            status: 0,
            flags: Flags::Other,
            can_be: ANY,
            constants: [None; 16],
        };
        if let Some(g) = gpr(Register::RSI) {
            start.request = 1 << g;
        }
        let mut seen: HashSet<(u64, PathState)> = HashSet::new();
        let mut stack = vec![(self.code.entry(), start)];
        while let Some((ip, state)) = stack.pop() {
            if self.steps >= MAX_STEPS || !seen.insert((ip, state.clone())) {
                continue;
            }
            self.steps += 1;
            let Some(ins) = self.code.decode(ip) else {
                // Past the in-progress test, a path that cannot be read may end a
                // transfer where no site is: no sites rather than wrong ones.
                if state.phase != Phase::Before {
                    self.unseen
                        .push(format!("the code at {ip:#x} cannot be decoded"));
                }
                continue;
            };
            if state.phase == Phase::Checking {
                self.request_at
                    .entry(ip)
                    .and_modify(|r| *r &= state.request)
                    .or_insert(state.request);
            }
            let mut next = state.clone();
            self.effects(&ins, &mut next);
            let after = ins.next_ip();
            let mut go = |to: u64, s: PathState, walk: &mut Self| {
                if s.phase == Phase::Checking {
                    walk.edges.insert((ip, to));
                }
                stack.push((to, s));
            };
            match ins.flow_control() {
                FlowControl::Return => match state.phase {
                    Phase::Checking => {
                        let eax = gpr(Register::RAX).and_then(|g| state.constants[g]);
                        self.stale_returns.push((ip, eax));
                    }
                    Phase::Answered if state.can_be & (ZERO | NEG) != 0 => {
                        self.unseen.push(format!(
                            "`{}` returns where the backend's answer may still be {}",
                            self.code.text(ip),
                            if state.can_be & ZERO != 0 {
                                "success"
                            } else {
                                "a failure"
                            }
                        ));
                    }
                    _ => {}
                },
                FlowControl::UnconditionalBranch => {
                    let to = ins.near_branch_target();
                    self.targets.entry(to).or_default().insert(ip);
                    go(to, next, self);
                }
                FlowControl::ConditionalBranch => {
                    let to = ins.near_branch_target();
                    self.targets.entry(to).or_default().insert(ip);
                    for (taken, dest) in [(true, to), (false, after)] {
                        let mut s = next.clone();
                        if let Some(can) = refine(ins.condition_code(), state.flags, taken) {
                            s.can_be &= can;
                            if s.can_be == 0 {
                                continue; // a path the status cannot take
                            }
                        }
                        let placed = match (state.phase, s.can_be) {
                            (Phase::Before, IN_PROG)
                                if state.flags == Flags::InProgress
                                    && self.which == Method::Release =>
                            {
                                self.in_progress_check = Some(ip);
                                Some(Kind::Released)
                            }
                            (Phase::Before, IN_PROG) if state.flags == Flags::InProgress => {
                                self.in_progress_check = Some(ip);
                                s.phase = Phase::Checking;
                                None
                            }
                            (Phase::Answered, ZERO) if state.flags == Flags::Status => {
                                Some(Kind::Succeeded)
                            }
                            (Phase::Answered, NEG) if state.flags == Flags::Status => {
                                Some(Kind::Failed)
                            }
                            _ => None,
                        };
                        match placed {
                            Some(kind) => self.found.push(Found {
                                kind,
                                at: dest,
                                request: s.request,
                                jump: ip,
                            }),
                            None => go(dest, s, self),
                        }
                    }
                }
                FlowControl::IndirectBranch => {
                    if state.phase != Phase::Before {
                        self.unseen.push(format!(
                            "`{}` jumps where it cannot be followed",
                            self.code.text(ip)
                        ));
                    }
                }
                FlowControl::Exception | FlowControl::Interrupt => {}
                // A throw, an unwind or an abort: the path ends there (what follows the
                // call is another block, or another function).
                FlowControl::Call
                    if (self.callee)(ins.near_branch_target())
                        .is_some_and(|n| never_returns(&n)) => {}
                _ => {
                    if state.phase == Phase::Checking && next.phase == Phase::Answered {
                        self.stored_at.insert(ip);
                    }
                    go(after, next, self);
                }
            }
        }
    }

    /// What one instruction does to the registers and flags a path tracks.
    fn effects(&mut self, ins: &Instruction, s: &mut PathState) {
        let m = ins.mnemonic();
        let reg = |i: u32| (ins.op_kind(i) == OpKind::Register).then(|| ins.op_register(i));
        let (op0, op1) = (reg(0), if ins.op_count() > 1 { reg(1) } else { None });
        let field = |i: u32| {
            (ins.op_kind(i) == OpKind::Memory
                && ins.memory_index() == Register::None
                && gpr(ins.memory_base()).is_some_and(|g| s.request & (1 << g) != 0))
            .then(|| ins.memory_displacement64())
        };
        // A store of the backend's answer to the request's status.
        if s.phase == Phase::Checking
            && m == Mnemonic::Mov
            && field(0) == Some(self.req_status)
            && op1 == Some(Register::EAX)
        {
            s.phase = Phase::Answered;
            s.can_be = ANY;
            s.status = 1 << Register::RAX.number();
            s.flags = Flags::Other;
            return;
        }
        if ins.rflags_modified() != 0 {
            s.flags = Flags::Other;
        }
        let is_status = |r: Option<Register>| {
            r.is_some_and(|r| r.size() == 4 && gpr(r).is_some_and(|g| s.status & (1 << g) != 0))
        };
        match m {
            // `cmpl $1` of the request's status in memory (releaseXferReq).
            Mnemonic::Cmp
                if field(0) == Some(self.req_status)
                    && is_immediate(ins.op1_kind())
                    && ins.immediate(1) as u32 == 1 =>
            {
                s.flags = Flags::InProgress
            }
            Mnemonic::Test if op0 == op1 && is_status(op0) => s.flags = Flags::Status,
            Mnemonic::Cmp if is_status(op0) && ins.op_count() == 2 => {
                s.flags = match ins.op1_kind() {
                    k if is_immediate(k) && ins.immediate(1) as u32 == 0 => Flags::Status,
                    k if is_immediate(k) && ins.immediate(1) as u32 == 1 => Flags::InProgress,
                    _ => Flags::Other,
                }
            }
            _ => {}
        }
        if matches!(
            ins.flow_control(),
            FlowControl::Call | FlowControl::IndirectCall
        ) {
            for g in CALLER_SAVED.into_iter().filter_map(gpr) {
                s.forget(g);
            }
            s.flags = Flags::Other;
            return;
        }
        // What the instruction moves before its writes clear the rest.
        let copied = match (m, op0, op1) {
            (Mnemonic::Mov, Some(d), Some(src)) => gpr(src).map(|g| {
                (
                    s.request & (1 << g) != 0 && src.size() == 8,
                    s.status & (1 << g) != 0 && src.size() == 4,
                    s.constants[g].filter(|_| src.size() == 4),
                    d,
                )
            }),
            _ => None,
        };
        let loaded_status = m == Mnemonic::Mov
            && op0.is_some_and(|r| r.size() == 4)
            && field(1) == Some(self.req_status);
        let constant = match (m, op0) {
            (Mnemonic::Mov, Some(d)) if d.size() == 4 && is_immediate(ins.op1_kind()) => {
                Some((d, ins.immediate(1) as u32 as i32))
            }
            (Mnemonic::Xor, Some(d)) if d.size() == 4 && op1 == Some(d) => Some((d, 0)),
            _ => None,
        };
        let info = self.info.info(ins);
        for used in info.used_registers() {
            if matches!(
                used.access(),
                OpAccess::Write
                    | OpAccess::CondWrite
                    | OpAccess::ReadWrite
                    | OpAccess::ReadCondWrite
            ) {
                if let Some(g) = gpr(used.register()) {
                    s.forget(g);
                }
            }
        }
        if let Some((request, status, value, d)) = copied {
            if let Some(g) = gpr(d) {
                if request && d.size() == 8 {
                    s.request |= 1 << g;
                }
                if status && d.size() == 4 {
                    s.status |= 1 << g;
                }
                if d.size() == 4 {
                    s.constants[g] = value;
                }
            }
        }
        if loaded_status {
            if let Some(g) = op0.and_then(gpr) {
                s.status |= 1 << g;
            }
        }
        if let Some((d, v)) = constant {
            if let Some(g) = gpr(d) {
                s.constants[g] = Some(v);
            }
        }
    }

    /// The first jump of the straight run from `at`, where no other path enters it and
    /// the request's register is not written on the way; else `at`.
    fn first_jump(&mut self, at: u64, request: u16, placed_by: u64) -> u64 {
        let mut ip = at;
        for _ in 0..8 {
            let Some(ins) = self.code.decode(ip) else {
                break;
            };
            let entered = self
                .targets
                .get(&ip)
                .is_some_and(|from| from.iter().any(|f| *f != placed_by));
            if ip != at && entered {
                break;
            }
            match ins.flow_control() {
                FlowControl::ConditionalBranch | FlowControl::UnconditionalBranch => return ip,
                FlowControl::Next => {}
                _ => break,
            }
            let writes = self.info.info(&ins).used_registers().iter().any(|u| {
                !matches!(
                    u.access(),
                    OpAccess::Read | OpAccess::CondRead | OpAccess::NoMemAccess
                ) && gpr(u.register()).is_some_and(|g| request & (1 << g) != 0)
            });
            if writes {
                break;
            }
            ip = ins.next_ip();
        }
        at
    }
}

/// The C++ runtime's functions that do not return, by their symbols.
pub(super) fn never_returns(name: &str) -> bool {
    (name.starts_with("_ZSt") && name.contains("__throw_"))
        || matches!(
            name,
            "__cxa_throw"
                | "__cxa_rethrow"
                | "__cxa_bad_cast"
                | "__cxa_bad_typeid"
                | "__cxa_throw_bad_array_new_length"
                | "__cxa_call_terminate"
                | "_ZSt9terminatev"
                | "_Unwind_Resume"
                | "__stack_chk_fail"
                | "__assert_fail"
                | "abort"
                | "exit"
                | "_exit"
        )
}

impl<'a, 'c> Walk<'a, 'c> {
    fn new(
        which: Method,
        method: MethodCode<'a>,
        req_status: u64,
        code_at: &'c dyn Fn(u64) -> Option<MethodCode<'a>>,
        callee: &'c dyn Fn(u64) -> Option<String>,
    ) -> Self {
        Walk {
            which,
            code: Listing::new(which.name(), method, code_at),
            callee,
            req_status,
            info: InstructionInfoFactory::new(),
            targets: BTreeMap::new(),
            found: Vec::new(),
            edges: BTreeSet::new(),
            stored_at: BTreeSet::new(),
            request_at: HashMap::new(),
            stale_returns: Vec::new(),
            unseen: Vec::new(),
            in_progress_check: None,
            steps: 0,
        }
    }

    /// Every path walked, or why not.
    fn walked(mut self) -> Result<Self, String> {
        self.run();
        if self.steps >= MAX_STEPS {
            return Err(format!(
                "{}'s paths were not all walked within {MAX_STEPS} instructions",
                self.which.name()
            ));
        }
        Ok(self)
    }
}

/// Where transfers end in `status` (`getXferStatus`) and `release`
/// (`releaseXferReq`), whose requests' status is at `req_status`; `code_at` gives the
/// code their jumps lead to, `callee` names a call's target.
pub fn end_sites<'a>(
    status: MethodCode<'a>,
    release: MethodCode<'a>,
    req_status: u64,
    code_at: &dyn Fn(u64) -> Option<MethodCode<'a>>,
    callee: &dyn Fn(u64) -> Option<String>,
) -> Result<EndSites, String> {
    let (released_in_flight, release_request, release_evidence) = released_in_flight(Walk::new(
        Method::Release,
        release,
        req_status,
        code_at,
        callee,
    ))?;
    let mut walk = Walk::new(Method::Status, status, req_status, code_at, callee).walked()?;
    let Some(check) = walk.in_progress_check else {
        return Err("getXferStatus tests no request status for in-progress (`cmp $1`)".into());
    };
    if walk.stored_at.is_empty() {
        return Err(format!(
            "no path past `{}` stores a backend's answer at the request's {req_status:#x}",
            walk.code.text(check)
        ));
    }
    if let Some(why) = walk.unseen.first() {
        return Err(format!(
            "{why}: a transfer's end can pass no site ({} such returns)",
            walk.unseen.len()
        ));
    }
    // The stale exits: edges from the in-progress branch's instructions that lead on to
    // the store to ones that never do.
    let mut reaches: BTreeSet<u64> = walk.stored_at.clone();
    loop {
        let before = reaches.len();
        for (from, to) in &walk.edges {
            if reaches.contains(to) {
                reaches.insert(*from);
            }
        }
        if reaches.len() == before {
            break;
        }
    }
    let mut stale_at: BTreeMap<u64, u64> = BTreeMap::new();
    let edges: Vec<(u64, u64)> = walk.edges.iter().copied().collect();
    for (from, to) in &edges {
        if reaches.contains(from) && !reaches.contains(to) {
            // Through plain jumps to the code they lead to.
            let mut at = *to;
            for _ in 0..4 {
                match walk.code.decode(at) {
                    Some(i) if i.flow_control() == FlowControl::UnconditionalBranch => {
                        at = i.near_branch_target()
                    }
                    _ => break,
                }
            }
            stale_at.entry(at).or_insert(*from);
        }
    }
    let returned: BTreeSet<Option<i32>> = walk.stale_returns.iter().map(|(_, v)| *v).collect();
    let stale_status = match (stale_at.is_empty(), returned.iter().next()) {
        (true, _) => 0,
        (false, Some(Some(v))) if returned.len() == 1 => *v,
        _ => {
            return Err(format!(
                "the paths that leave the in-progress branch without asking the backend \
                 return {} (not one constant status)",
                returned
                    .iter()
                    .map(|v| v.map_or("a computed value".to_string(), |v| v.to_string()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        }
    };
    for (at, from) in &stale_at {
        let request = walk.request_at.get(at).copied().unwrap_or(0);
        walk.found.push(Found {
            kind: Kind::Stale,
            at: *at,
            request,
            jump: *from,
        });
    }
    for kind in [Kind::Succeeded, Kind::Failed] {
        if !walk.found.iter().any(|f| f.kind == kind) {
            return Err(format!(
                "no path past `{}` is left with only a {} answer",
                walk.code.text(check),
                if kind == Kind::Succeeded {
                    "successful"
                } else {
                    "failed"
                }
            ));
        }
    }
    let mut evidence = vec![
        format!("in progress: {}", walk.code.text(check)),
        format!(
            "answer stored: {}",
            walk.code.text(*walk.stored_at.iter().next().unwrap_or(&0))
        ),
    ];
    let mut sites: BTreeMap<Kind, BTreeSet<u64>> = BTreeMap::new();
    let mut request = u16::MAX;
    let found = std::mem::take(&mut walk.found);
    for f in &found {
        let at = walk.first_jump(f.at, f.request, f.jump);
        request &= f.request;
        if sites.entry(f.kind).or_default().insert(at) {
            walk.code.decode(at);
            evidence.push(format!(
                "{}: {} then {}",
                f.kind.label(),
                walk.code.text(f.jump),
                walk.code.text(at)
            ));
        }
    }
    let request = (0..16)
        .filter(|g| request & (1 << g) != 0)
        .find_map(site_reg)
        .ok_or("no callee-saved register holds the request at every site")?;
    let mut of = |k: Kind| sites.remove(&k).unwrap_or_default().into_iter().collect();
    evidence.extend(release_evidence);
    Ok(EndSites {
        succeeded: of(Kind::Succeeded),
        failed: of(Kind::Failed),
        stale: of(Kind::Stale),
        stale_status,
        request,
        released_in_flight,
        release_request,
        evidence,
    })
}

/// `releaseXferReq`'s paths where the request's status is still in progress: their
/// first instructions, the request's register there, and the evidence.
fn released_in_flight(walk: Walk<'_, '_>) -> Result<(Vec<u64>, SiteReg, Vec<String>), String> {
    let mut walk = walk.walked()?;
    let Some(check) = walk.in_progress_check else {
        return Err(
            "releaseXferReq compares no request status with in progress (`cmpl $1`)".into(),
        );
    };
    let mut sites = BTreeSet::new();
    let mut request = u16::MAX;
    let mut evidence = Vec::new();
    let found = std::mem::take(&mut walk.found);
    for f in found.iter().filter(|f| f.kind == Kind::Released) {
        let at = walk.first_jump(f.at, f.request, f.jump);
        request &= f.request;
        if sites.insert(at) {
            walk.code.decode(at);
            evidence.push(format!(
                "{}: {} then {}",
                f.kind.label(),
                walk.code.text(f.jump),
                walk.code.text(at)
            ));
        }
    }
    let request = (0..16)
        .filter(|g| request & (1 << g) != 0)
        .find_map(site_reg)
        .ok_or_else(|| {
            format!(
                "no callee-saved register holds the request past `{}`",
                walk.code.text(check)
            )
        })?;
    Ok((sites.into_iter().collect(), request, evidence))
}
