//! Where `createXferReq` and `makeXferReq` fail, read from their instructions, so that
//! every build sees a failed creation at a site on its path and a successful one not at
//! all (it is learned from its post, which reads the request).
//!
//! The method's paths are walked from its first instruction into its cold part, knowing
//! along each what the 4-byte values can still be (negative, zero, positive, or one
//! constant) and which registers and frame slots hold the same value, refined at each
//! conditional jump on a test of one of them against zero. A return gives what `eax`
//! holds there. An instruction is on a failure path when no path through it returns a
//! status that may be zero; the sites are the first such instruction of each path
//! (never run by a success). A loop only failures run is passed on to where it leads
//! (its first instruction would run once per turn), and a jump into a failure block
//! other paths share is left to that block. Every return that may give a failure must
//! pass one site, and no site may lead to another: then each failure is seen once, and
//! nothing else is.
//!
//! At each site, what the probe reads: the status (a constant every path from there
//! returns, or the register or slot whose value every return gives, followed value by
//! value); whether the request is built (the allocation the method later stores through
//! its `req_hndl` argument); and where `this`, the op and the remote agent's name (or the
//! request, once built) are on every path to it (a must-hold pass over registers and
//! frame slots). A path that fails before `this` leaves its argument register names that
//! register in its cookie.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use iced_x86::{
    ConditionCode, FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpKind, Register,
};

use super::listing::{written, Graph, Listing};
use super::{any_site_reg, gpr, is_immediate, site_reg, MethodCode, CALLER_SAVED};
use crate::nixl::offsets::{failure_cookie, CreationArgs, SiteReg, SiteValue};

/// Which creating method, and how it takes its arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Creator {
    /// `createXferReq(const op&, local&, remote&, const std::string& remote_agent,
    /// nixlXferReqH*& req, …)`.
    Create,
    /// `makeXferReq(op, const nixlDlistH&, span, const nixlDlistH&, span, req&, …)`
    /// (1.5 on): the op by value, `req` the third word on the stack.
    MakeSpan,
    /// `makeXferReq(const op&, nixlDlistH*, const std::vector<int>&, nixlDlistH*,
    /// const std::vector<int>&, req&, …)` (before 1.5): `req` the first word on the stack.
    MakeByReference,
}

impl Creator {
    /// Its symbol's prefix.
    pub(crate) fn symbol(self) -> &'static str {
        match self {
            Creator::Create => super::CREATE,
            Creator::MakeSpan => super::MAKE_SPAN,
            Creator::MakeByReference => super::MAKE_BY_REFERENCE,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Creator::Create => "createXferReq",
            Creator::MakeSpan | Creator::MakeByReference => "makeXferReq",
        }
    }
}

/// One failure path's site.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub at: u64,
    pub status: SiteValue,
    /// The request is built there (its op and remote agent are read from it).
    pub request_built: bool,
    /// Where `this` is on this path when not in the method's usual place (a path that
    /// fails before the method moves it from its argument register).
    pub agent: Option<SiteReg>,
}

impl Failure {
    /// Its probe's cookie (`xfer_creation_failed` in `ebpf/nixl/xfer.bpf.c`).
    pub fn cookie(&self, in_make: bool) -> u64 {
        failure_cookie(self.status, self.request_built, in_make, self.agent)
    }
}

/// Where one method fails, and where its arguments are at those sites.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreationSites {
    /// The method's symbol prefix (the overload that implements it).
    pub symbol: &'static str,
    pub failed: Vec<Failure>,
    pub args: CreationArgs,
    pub evidence: Vec<String>,
}

/// Status values a path may still hold, as bits.
const NEG: u8 = 1;
const ZERO: u8 = 2;
const POS: u8 = 4;
const ANY: u8 = NEG | ZERO | POS;

/// States walked in all: a bound for unexpected code.
const MAX_STATES: usize = 60_000;

/// A register (by its 64-bit number) or a frame slot (by its offset from `rbp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Loc {
    Reg(usize),
    Slot(i64),
}

/// What a value can be: its class bits, its constant where known.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Val {
    id: u32,
    can: u8,
    konst: Option<i32>,
    /// The value a failure site's status was (followed to the returns).
    marked: bool,
}

fn class(v: i32) -> u8 {
    match v {
        v if v < 0 => NEG,
        0 => ZERO,
        _ => POS,
    }
}

/// The values a path tracks, canonical (so that paths agreeing on them meet).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
struct State {
    vals: BTreeMap<Loc, Val>,
    /// The value the flags tested against zero.
    flags: Option<u32>,
    next_id: u32,
}

impl State {
    fn fresh(&mut self, at: Loc, can: u8, konst: Option<i32>) {
        self.next_id += 1;
        self.vals.insert(
            at,
            Val {
                id: self.next_id,
                can,
                konst,
                marked: false,
            },
        );
    }

    /// Forget what nothing can tell from nothing (a lone unknown value), and number the
    /// values in the order of their places.
    fn canonical(mut self) -> State {
        let mut count: HashMap<u32, usize> = HashMap::new();
        for v in self.vals.values() {
            *count.entry(v.id).or_default() += 1;
        }
        let flags = self.flags;
        self.vals.retain(|_, v| {
            v.can != ANY || v.konst.is_some() || v.marked || count[&v.id] > 1 || flags == Some(v.id)
        });
        let mut renumber: HashMap<u32, u32> = HashMap::new();
        for v in self.vals.values_mut() {
            let n = renumber.len() as u32 + 1;
            v.id = *renumber.entry(v.id).or_insert(n);
        }
        self.flags = self.flags.and_then(|f| renumber.get(&f).copied());
        self.next_id = renumber.len() as u32;
        self
    }
}

/// The place an operand names: a register, or a slot of the frame (`disp(%rbp)`).
fn loc_of(ins: &Instruction, i: u32) -> Option<Loc> {
    match ins.op_kind(i) {
        OpKind::Register => gpr(ins.op_register(i)).map(Loc::Reg),
        OpKind::Memory
            if ins.memory_base() == Register::RBP && ins.memory_index() == Register::None =>
        {
            Some(Loc::Slot(ins.memory_displacement64() as i64))
        }
        _ => None,
    }
}

fn operand_size(ins: &Instruction, i: u32) -> usize {
    match ins.op_kind(i) {
        OpKind::Register => ins.op_register(i).size(),
        OpKind::Memory => ins.memory_size().size(),
        _ => 0,
    }
}

/// The places a status can be kept in: a register (not the stack pointer), the frame.
fn tracked(l: Loc) -> bool {
    match l {
        Loc::Reg(g) => gpr(Register::RSP) != Some(g),
        Loc::Slot(d) => d < 0,
    }
}

/// Run one instruction on the values a path tracks (4-byte values only: a status).
fn step(ins: &Instruction, s: &mut State, info: &mut InstructionInfoFactory) {
    let m = ins.mnemonic();
    if matches!(
        ins.flow_control(),
        FlowControl::Call | FlowControl::IndirectCall
    ) {
        for g in CALLER_SAVED.into_iter().filter_map(gpr) {
            s.vals.remove(&Loc::Reg(g));
        }
        s.flags = None;
        return;
    }
    // The flags, tested against zero.
    let tested = match m {
        Mnemonic::Test
            if ins.op0_kind() == OpKind::Register
                && ins.op1_kind() == OpKind::Register
                && ins.op0_register() == ins.op1_register()
                && ins.op0_register().size() == 4 =>
        {
            loc_of(ins, 0).filter(|l| tracked(*l))
        }
        Mnemonic::Cmp
            if is_immediate(ins.op1_kind())
                && ins.immediate(1) == 0
                && operand_size(ins, 0) == 4 =>
        {
            loc_of(ins, 0).filter(|l| tracked(*l))
        }
        _ => None,
    };
    if let Some(at) = tested {
        if !s.vals.contains_key(&at) {
            s.fresh(at, ANY, None);
        }
        s.flags = s.vals.get(&at).map(|v| v.id);
        return;
    }
    let dest = loc_of(ins, 0).filter(|_| ins.op_count() > 0);
    // What the instruction moves, read before its writes.
    let moved: Option<(Loc, Option<Val>)> = match (m, dest) {
        (Mnemonic::Mov, Some(d)) if operand_size(ins, 0) == 4 && tracked(d) => {
            let v = if is_immediate(ins.op1_kind()) {
                let k = ins.immediate(1) as u32 as i32;
                Some(Val {
                    id: 0,
                    can: class(k),
                    konst: Some(k),
                    marked: false,
                })
            } else {
                // An unknown value moved is still one value in two places.
                let src = loc_of(ins, 1).filter(|l| tracked(*l) && operand_size(ins, 1) == 4);
                if let Some(src) = src {
                    if !s.vals.contains_key(&src) {
                        s.fresh(src, ANY, None);
                    }
                }
                src.and_then(|src| s.vals.get(&src).copied())
            };
            Some((d, v))
        }
        (Mnemonic::Xor, Some(d @ Loc::Reg(_)))
            if ins.op1_kind() == OpKind::Register
                && ins.op0_register() == ins.op1_register()
                && tracked(d) =>
        {
            Some((
                d,
                Some(Val {
                    id: 0,
                    can: ZERO,
                    konst: Some(0),
                    marked: false,
                }),
            ))
        }
        _ => None,
    };
    let result_tested = matches!(m, Mnemonic::Or | Mnemonic::And)
        && operand_size(ins, 0) == 4
        && dest.is_some_and(tracked);
    // Every place written loses its value.
    let w = written(ins, info);
    for g in w.regs {
        s.vals.remove(&Loc::Reg(g));
    }
    for (from, to) in w.frame {
        s.vals
            .retain(|l, _| !matches!(l, Loc::Slot(at) if *at < to && from < *at + 4));
    }
    if ins.rflags_modified() != 0 {
        s.flags = None;
    }
    match moved {
        Some((d, Some(v))) if v.id != 0 => {
            s.vals.insert(d, v);
        }
        Some((d, Some(v))) => s.fresh(d, v.can, v.konst),
        _ => {}
    }
    if result_tested {
        if let Some(d) = dest {
            s.fresh(d, ANY, None);
            s.flags = s.vals.get(&d).map(|v| v.id);
        }
    }
}

/// What a jump taken (or not) on a test against zero leaves possible.
fn refine(cc: ConditionCode, taken: bool) -> Option<u8> {
    let when_taken = match cc {
        ConditionCode::e => ZERO,
        ConditionCode::ne => NEG | POS,
        ConditionCode::s | ConditionCode::l => NEG,
        ConditionCode::ns | ConditionCode::ge => ZERO | POS,
        ConditionCode::g => POS,
        ConditionCode::le => NEG | ZERO,
        _ => return None,
    };
    Some(if taken { when_taken } else { ANY & !when_taken })
}

/// Where a path goes from `ip` (holding `ins`) in `state`: each next instruction a
/// feasible edge leads to, with the state there.
fn successors(
    graph: &Graph,
    ins: &Instruction,
    ip: u64,
    state: &State,
    info: &mut InstructionInfoFactory,
) -> Vec<(u64, State)> {
    let mut after = state.clone();
    step(ins, &mut after, info);
    let next = graph.next.get(&ip).cloned().unwrap_or_default();
    let mut out = Vec::new();
    for to in next {
        let mut s = after.clone();
        if ins.flow_control() == FlowControl::ConditionalBranch {
            if let (Some(id), Some(mask)) = (
                state.flags,
                refine(ins.condition_code(), to == ins.near_branch_target()),
            ) {
                let mut feasible = true;
                for v in s.vals.values_mut().filter(|v| v.id == id) {
                    v.can &= mask;
                    feasible &= v.can != 0 && v.konst.is_none_or(|k| class(k) & mask != 0);
                }
                if !feasible {
                    continue;
                }
            }
        }
        out.push((to, s.canonical()));
    }
    out
}

/// The walk's states and their edges.
struct Walked {
    nodes: Vec<(u64, State)>,
    edges: Vec<(usize, usize)>,
    /// Each node's successors, and its predecessors.
    forward: Vec<Vec<usize>>,
    backward: Vec<Vec<usize>>,
    /// Return nodes, with what `eax` can be there.
    returns: Vec<(usize, u8, Option<i32>)>,
}

fn walk(graph: &Graph, entry: u64, name: &str) -> Result<Walked, String> {
    let mut info = InstructionInfoFactory::new();
    let mut index: HashMap<(u64, State), usize> = HashMap::new();
    let mut w = Walked {
        nodes: Vec::new(),
        edges: Vec::new(),
        forward: Vec::new(),
        backward: Vec::new(),
        returns: Vec::new(),
    };
    let mut stack: Vec<(Option<usize>, u64, State)> = vec![(None, entry, State::default())];
    let rax = gpr(Register::RAX).unwrap_or_default();
    while let Some((from, ip, state)) = stack.pop() {
        let key = (ip, state);
        if let Some(n) = index.get(&key) {
            if let Some(f) = from {
                w.edges.push((f, *n));
            }
            continue;
        }
        if w.nodes.len() >= MAX_STATES {
            return Err(format!(
                "{name}'s paths were not all walked within {MAX_STATES} states"
            ));
        }
        let n = w.nodes.len();
        index.insert(key.clone(), n);
        w.nodes.push(key.clone());
        if let Some(f) = from {
            w.edges.push((f, n));
        }
        let (_, state) = key;
        let Some(ins) = graph.instructions.get(&ip) else {
            continue;
        };
        if ins.flow_control() == FlowControl::Return {
            let v = state.vals.get(&Loc::Reg(rax));
            w.returns
                .push((n, v.map_or(ANY, |v| v.can), v.and_then(|v| v.konst)));
            continue;
        }
        for (to, next) in successors(graph, ins, ip, &state, &mut info) {
            stack.push((Some(n), to, next));
        }
    }
    w.forward = vec![Vec::new(); w.nodes.len()];
    w.backward = vec![Vec::new(); w.nodes.len()];
    for (f, t) in &w.edges {
        w.forward[*f].push(*t);
        w.backward[*t].push(*f);
    }
    Ok(w)
}

impl Walked {
    /// The nodes reached from `from` (included), forward or backward, never past a node
    /// `stop` holds (which is reached, not passed).
    fn reach(&self, from: Vec<usize>, forward: bool, stop: impl Fn(usize) -> bool) -> Vec<bool> {
        let edges = if forward {
            &self.forward
        } else {
            &self.backward
        };
        let mut seen = vec![false; self.nodes.len()];
        let mut stack = from;
        while let Some(n) = stack.pop() {
            if std::mem::replace(&mut seen[n], true) || stop(n) {
                continue;
            }
            stack.extend(edges[n].iter().copied());
        }
        seen
    }
}

/// Where each argument (or the request) is: the values a must-hold pass tracks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Held {
    This,
    /// The op's address (passed by reference) or the op itself.
    OpRef,
    OpVal,
    RemoteRef,
    /// The `req_hndl` argument (a `nixlXferReqH*&`).
    Handle,
    /// What the allocation at this call returned.
    Alloc(u64),
}

type Holds = BTreeMap<Loc, Held>;

/// The must-hold pass: for each instruction, the places that hold each argument on
/// every path to it, and the allocations that may have run before it.
fn holds(
    graph: &Graph,
    entry: u64,
    creator: Creator,
    callee: &dyn Fn(u64) -> Option<String>,
) -> Result<HashMap<u64, (Holds, BTreeSet<u64>)>, String> {
    let reg = |r: Register| Loc::Reg(gpr(r).unwrap_or_default());
    let mut start: Holds = BTreeMap::new();
    start.insert(reg(Register::RDI), Held::This);
    match creator {
        Creator::Create => {
            start.insert(reg(Register::RSI), Held::OpRef);
            start.insert(reg(Register::R8), Held::RemoteRef);
            start.insert(reg(Register::R9), Held::Handle);
        }
        Creator::MakeSpan => {
            start.insert(reg(Register::RSI), Held::OpVal);
            start.insert(Loc::Slot(0x20), Held::Handle);
        }
        Creator::MakeByReference => {
            start.insert(reg(Register::RSI), Held::OpRef);
            start.insert(Loc::Slot(0x10), Held::Handle);
        }
    }
    let mut info = InstructionInfoFactory::new();
    let mut at: HashMap<u64, (Holds, BTreeSet<u64>)> = HashMap::new();
    at.insert(entry, (start, BTreeSet::new()));
    let mut work: BTreeSet<u64> = [entry].into();
    let mut rounds = 0;
    while let Some(ip) = work.pop_first() {
        rounds += 1;
        if rounds > MAX_STATES {
            // Unsettled, the places would claim more than every path holds.
            return Err(format!(
                "{}'s arguments were not followed to every site within {MAX_STATES} steps",
                creator.name()
            ));
        }
        let Some(ins) = graph.instructions.get(&ip) else {
            continue;
        };
        let (mut h, mut allocs) = at[&ip].clone();
        if matches!(
            ins.flow_control(),
            FlowControl::Call | FlowControl::IndirectCall
        ) {
            h.retain(|l, _| !matches!(l, Loc::Reg(g) if CALLER_SAVED.iter().any(|r| gpr(*r) == Some(*g))));
            let target = ins.near_branch_target();
            let name = (ins.flow_control() == FlowControl::Call)
                .then(|| callee(target))
                .flatten();
            if name.is_some_and(|n| n.starts_with("_Znwm")) {
                h.insert(reg(Register::RAX), Held::Alloc(ip));
                allocs.insert(ip);
            }
        } else {
            let moved = match (ins.mnemonic(), loc_of(ins, 0)) {
                (Mnemonic::Mov, Some(d)) if ins.op_count() == 2 => {
                    let size = operand_size(ins, 0);
                    loc_of(ins, 1)
                        .and_then(|src| h.get(&src).copied())
                        .filter(|v| (size == 8) || (size == 4 && *v == Held::OpVal))
                        .map(|v| (d, v))
                }
                _ => None,
            };
            let w = written(ins, &mut info);
            for g in w.regs {
                h.remove(&Loc::Reg(g));
            }
            for (from, to) in w.frame {
                h.retain(|l, _| !matches!(l, Loc::Slot(a) if *a < to && from < *a + 8));
            }
            if let Some((d, v)) = moved {
                h.insert(d, v);
            }
        }
        for to in graph.next.get(&ip).into_iter().flatten() {
            let merged = match at.get(to) {
                None => (h.clone(), allocs.clone()),
                Some((old, old_allocs)) => {
                    let mut m = old.clone();
                    m.retain(|l, v| h.get(l) == Some(v));
                    let mut a = old_allocs.clone();
                    a.extend(allocs.iter().copied());
                    (m, a)
                }
            };
            if at.get(to) != Some(&merged) {
                at.insert(*to, merged);
                work.insert(*to);
            }
        }
    }
    Ok(at)
}

/// The request: the allocation the method stores through its `req_hndl` argument.
fn request(graph: &Graph, held: &HashMap<u64, (Holds, BTreeSet<u64>)>) -> Option<u64> {
    let mut found = BTreeSet::new();
    for (ip, ins) in &graph.instructions {
        let Some((h, _)) = held.get(ip) else { continue };
        if ins.mnemonic() != Mnemonic::Mov
            || ins.op0_kind() != OpKind::Memory
            || ins.memory_index() != Register::None
            || ins.memory_displacement64() != 0
            || ins.op1_kind() != OpKind::Register
        {
            continue;
        }
        let base = gpr(ins.memory_base()).map(Loc::Reg);
        if base.and_then(|b| h.get(&b)) != Some(&Held::Handle) {
            continue;
        }
        if let Some(Held::Alloc(a)) = gpr(ins.op1_register()).and_then(|g| h.get(&Loc::Reg(g))) {
            found.insert(*a);
        }
    }
    (found.len() == 1).then(|| *found.first().unwrap_or(&0))
}

/// Where `value` is held at every one of `sites`: a callee-saved register first, else a
/// slot below the frame pointer.
fn held_at(sites: &[u64], held: &HashMap<u64, (Holds, BTreeSet<u64>)>, value: Held) -> Option<Loc> {
    let mut common: Option<BTreeSet<Loc>> = None;
    for s in sites {
        let here: BTreeSet<Loc> = held
            .get(s)
            .map(|(h, _)| {
                h.iter()
                    .filter(|(_, v)| **v == value)
                    .map(|(l, _)| *l)
                    .collect()
            })
            .unwrap_or_default();
        common = Some(match common {
            None => here,
            Some(c) => c.intersection(&here).copied().collect(),
        });
    }
    let common = common?;
    common
        .iter()
        .find(|l| matches!(l, Loc::Reg(g) if site_reg(*g).is_some()))
        .or_else(|| common.iter().find(|l| matches!(l, Loc::Slot(d) if *d < 0)))
        .or_else(|| {
            common
                .iter()
                .find(|l| matches!(l, Loc::Reg(g) if any_site_reg(*g).is_some()))
        })
        .copied()
}

fn site_value(at: Loc, by_reference: bool) -> Option<SiteValue> {
    match at {
        Loc::Reg(g) if by_reference => any_site_reg(g).map(SiteValue::RegRef),
        Loc::Reg(g) => any_site_reg(g).map(SiteValue::Reg),
        Loc::Slot(d) if d < 0 => {
            let below = u32::try_from(-d).ok()?;
            Some(if by_reference {
                SiteValue::FrameRef(below)
            } else {
                SiteValue::Frame(below)
            })
        }
        _ => None,
    }
}

/// Where `method` (a `creator`) fails; `code_at` gives the code its jumps lead to,
/// `callee` names a call's target.
pub fn creation_sites<'a>(
    creator: Creator,
    method: MethodCode<'a>,
    code_at: &dyn Fn(u64) -> Option<MethodCode<'a>>,
    callee: &dyn Fn(u64) -> Option<String>,
) -> Result<CreationSites, String> {
    let name = creator.name();
    let mut code = Listing::new(name, method, code_at);
    let graph = Graph::walk(&mut code, callee)?;
    let entry = code.entry();
    let walked = walk(&graph, entry, name)?;
    let sites = failure_sites(&graph, &walked, &mut code, name)?;
    // Each site's status: the constant every path from it returns, or the place
    // holding it unchanged to the return.
    let held = holds(&graph, entry, creator, callee)?;
    let req = request(&graph, &held);
    let mut failed = Vec::new();
    let mut evidence = Vec::new();
    for s in &sites {
        let starts: Vec<usize> = (0..walked.nodes.len())
            .filter(|n| walked.nodes[*n].0 == *s)
            .collect();
        let reached = walked.reach(starts.clone(), true, |_| false);
        let outcomes: BTreeSet<Option<i32>> = walked
            .returns
            .iter()
            .filter(|(n, ..)| reached[*n])
            .map(|(_, _, k)| *k)
            .collect();
        let status = match outcomes.iter().collect::<Vec<_>>().as_slice() {
            [Some(k)] => SiteValue::Const(*k),
            _ => kept_status(&graph, &walked, &starts, &reached).ok_or_else(|| {
                format!(
                    "the failure at `{}` returns a status not kept in one place",
                    code.text(*s)
                )
            })?,
        };
        let (h, allocs) = held.get(s).cloned().unwrap_or_default();
        let built = match req {
            Some(r) if h.values().any(|v| *v == Held::Alloc(r)) => true,
            Some(r) if !allocs.contains(&r) => false,
            None if allocs.is_empty() => false,
            _ => {
                return Err(format!(
                    "at `{}` the request may or may not be built",
                    code.text(*s)
                ))
            }
        };
        failed.push(Failure {
            at: *s,
            status,
            request_built: built,
            agent: None,
        });
    }
    let args = arguments(creator, &mut failed, &held, req, &code)?;
    for f in &failed {
        evidence.push(format!(
            "failed ({:?}{}{}): {}",
            f.status,
            if f.request_built {
                ", request built"
            } else {
                ""
            },
            f.agent
                .map(|r| format!(", this in {r:?}"))
                .unwrap_or_default(),
            code.text(f.at)
        ));
    }
    evidence.push(format!("arguments: {args:?}"));
    Ok(CreationSites {
        symbol: creator.symbol(),
        failed,
        args,
        evidence,
    })
}

/// The first instruction of each failure path (see the module's comment), or why the
/// failures cannot all be seen once.
fn failure_sites(
    graph: &Graph,
    walked: &Walked,
    code: &mut Listing<'_, '_>,
    name: &str,
) -> Result<BTreeSet<u64>, String> {
    // Nodes from which a return that may succeed is reached, and those from which any
    // return is.
    let closure = |from: Vec<usize>| walked.reach(from, false, |_| false);
    let succeeds = closure(
        walked
            .returns
            .iter()
            .filter(|(_, can, _)| can & ZERO != 0)
            .map(|(n, ..)| *n)
            .collect(),
    );
    let returns = closure(walked.returns.iter().map(|(n, ..)| *n).collect());
    // The instructions only failing paths run (and that lead to a return).
    let mut may_succeed: HashSet<u64> = HashSet::new();
    let mut may_return: HashSet<u64> = HashSet::new();
    for (n, (ip, _)) in walked.nodes.iter().enumerate() {
        if succeeds[n] {
            may_succeed.insert(*ip);
        }
        if returns[n] {
            may_return.insert(*ip);
        }
    }
    let failing_anywhere = |ip: &u64| !may_succeed.contains(ip) && may_return.contains(ip);
    // A loop only failures run (a search that can only end in one) is not a site: its
    // first instruction would run once per turn; the site is where the loop leads.
    let looping: HashSet<u64> = graph
        .instructions
        .keys()
        .filter(|ip| failing_anywhere(ip))
        .filter(|ip| {
            let mut seen = HashSet::new();
            let mut stack: Vec<u64> = graph.next.get(ip).cloned().unwrap_or_default();
            while let Some(x) = stack.pop() {
                if x == **ip {
                    return true;
                }
                if failing_anywhere(&x) && seen.insert(x) {
                    stack.extend(graph.next.get(&x).into_iter().flatten());
                }
            }
            false
        })
        .copied()
        .collect();
    let failing = |ip: &u64| failing_anywhere(ip) && !looping.contains(ip);
    let mut sites: BTreeSet<u64> = BTreeSet::new();
    for (f, t) in &walked.edges {
        let (from, to) = (walked.nodes[*f].0, walked.nodes[*t].0);
        if failing(&to) && !failing_anywhere(&from) {
            sites.insert(to);
        }
    }
    // A site every path of which runs through another (a jump to a failure block other
    // paths enter too) is left to that one.
    let ret_ips: Vec<u64> = graph.returns.clone();
    let through: Vec<u64> = sites
        .iter()
        .copied()
        .filter(|a| {
            let onward = graph.next.get(a).cloned().unwrap_or_default();
            sites.iter().any(|b| {
                b != a
                    && graph.reach(&onward, None, true).contains(b)
                    && !ret_ips
                        .iter()
                        .any(|r| graph.reach(&onward, Some(*b), true).contains(r))
            })
        })
        .collect();
    for a in through {
        sites.remove(&a);
    }
    if sites.is_empty() {
        return Err(format!("no path of {name} is known to fail"));
    }
    // Every return that may give a failure passes a site; none passes two.
    let seen = walked.reach(vec![0], true, |n| sites.contains(&walked.nodes[n].0));
    if let Some((n, ..)) = walked
        .returns
        .iter()
        .find(|(n, can, _)| seen[*n] && can & !ZERO != 0)
    {
        return Err(format!(
            "`{}` may return a failure no site sees",
            code.text(walked.nodes[*n].0)
        ));
    }
    for s in &sites {
        let onward: Vec<u64> = graph.next.get(s).cloned().unwrap_or_default();
        let after = graph.reach(&onward, None, true);
        if let Some(other) = sites.iter().find(|o| after.contains(o)) {
            code.decode(*other);
            return Err(format!(
                "`{}` leads to another failure site, `{}`",
                code.text(*s),
                code.text(*other)
            ));
        }
    }
    Ok(sites)
}

/// Where `this`, the op, the remote agent and the request are at the failure sites
/// that read them; a site where `this` is not in its usual place gets its register.
fn arguments(
    creator: Creator,
    failed: &mut [Failure],
    held: &HashMap<u64, (Holds, BTreeSet<u64>)>,
    req: Option<u64>,
    code: &Listing<'_, '_>,
) -> Result<CreationArgs, String> {
    let name = creator.name();
    // The arguments, at every site that reads them.
    let all: Vec<u64> = failed.iter().map(|f| f.at).collect();
    let unbuilt: Vec<u64> = failed
        .iter()
        .filter(|f| !f.request_built)
        .map(|f| f.at)
        .collect();
    let built: Vec<u64> = failed
        .iter()
        .filter(|f| f.request_built)
        .map(|f| f.at)
        .collect();
    let place = |sites: &[u64], value: Held, by_reference: bool, what: &str| {
        if sites.is_empty() {
            return Ok(SiteValue::Const(0));
        }
        held_at(sites, held, value)
            .and_then(|l| site_value(l, by_reference))
            .ok_or_else(|| format!("{what} is in no one place at every failure site of {name}"))
    };
    let op = match creator {
        Creator::MakeSpan => place(&unbuilt, Held::OpVal, false, "the op")?,
        _ => place(&unbuilt, Held::OpRef, true, "the op's address")?,
    };
    // `this`: where most sites find it; the others name their register.
    let mut counts: BTreeMap<Loc, usize> = BTreeMap::new();
    for s in &all {
        if let Some(l) = held_at(&[*s], held, Held::This) {
            *counts.entry(l).or_default() += 1;
        }
    }
    let usual = counts
        .iter()
        .filter(|(l, _)| site_value(**l, false).is_some())
        .max_by_key(|(_, n)| **n)
        .map(|(l, _)| *l)
        .ok_or_else(|| format!("this is in no place a failure site of {name} can read"))?;
    for f in failed.iter_mut() {
        let here: BTreeSet<Loc> = held
            .get(&f.at)
            .map(|(h, _)| {
                h.iter()
                    .filter(|(_, v)| **v == Held::This)
                    .map(|(l, _)| *l)
                    .collect()
            })
            .unwrap_or_default();
        if !here.contains(&usual) {
            f.agent = Some(
                here.iter()
                    .find_map(|l| match l {
                        Loc::Reg(g) => any_site_reg(*g),
                        Loc::Slot(_) => None,
                    })
                    .ok_or_else(|| format!("this is in no register at `{}`", code.text(f.at)))?,
            );
        }
    }
    Ok(CreationArgs {
        agent: site_value(usual, false).unwrap_or(SiteValue::Const(0)),
        op,
        remote_ref: match creator {
            Creator::Create => Some(place(&unbuilt, Held::RemoteRef, false, "the remote agent")?),
            _ => None,
        },
        request: match req {
            Some(r) => place(&built, Held::Alloc(r), false, "the request")?,
            None => SiteValue::Const(0),
        },
    })
}

/// The place (a callee-saved register, or a slot below the frame pointer) that holds a
/// failure's status at its site and is not written on the way to the return that gives
/// it.
fn kept_status(
    graph: &Graph,
    walked: &Walked,
    starts: &[usize],
    reached: &[bool],
) -> Option<SiteValue> {
    let rax = gpr(Register::RAX)?;
    // The places whose value the returns give, at the site's every state.
    let mut common: Option<BTreeSet<Loc>> = None;
    for n in starts {
        let state = &walked.nodes[*n].1;
        let here: BTreeSet<Loc> = state
            .vals
            .iter()
            .filter(|(l, v)| **l != Loc::Reg(rax) && tracked(**l) && v.can & ZERO == 0)
            .map(|(l, _)| *l)
            .collect();
        common = Some(match common {
            None => here,
            Some(c) => c.intersection(&here).copied().collect(),
        });
    }
    let ips: BTreeSet<u64> = (0..walked.nodes.len())
        .filter(|n| reached[*n])
        .map(|n| walked.nodes[n].0)
        .collect();
    common?.into_iter().find_map(|l| {
        // What eax returns is read from it, and nothing writes it on the way there.
        let reads: Vec<u64> = ips
            .iter()
            .copied()
            .filter(|ip| {
                graph.instructions.get(ip).is_some_and(|ins| {
                    ins.mnemonic() == Mnemonic::Mov
                        && ins.op0_kind() == OpKind::Register
                        && gpr(ins.op0_register()) == Some(rax)
                        && loc_of(ins, 1) == Some(l)
                })
            })
            .collect();
        (!reads.is_empty() && keeps(graph, walked, starts, l))
            .then(|| site_value(l, false))
            .flatten()
    })
}

/// Whether every return reached from the site's states gives the value `l` holds there.
fn keeps(graph: &Graph, walked: &Walked, starts: &[usize], l: Loc) -> bool {
    let Some(rax) = gpr(Register::RAX) else {
        return false;
    };
    let mut info = InstructionInfoFactory::new();
    let mut seen: HashSet<(u64, State)> = HashSet::new();
    let mut stack = Vec::new();
    for n in starts {
        let (ip, state) = &walked.nodes[*n];
        let mut s = state.clone();
        let Some(id) = s.vals.get(&l).map(|v| v.id) else {
            return false;
        };
        for v in s.vals.values_mut().filter(|v| v.id == id) {
            v.marked = true;
        }
        stack.push((*ip, s));
    }
    while let Some((ip, state)) = stack.pop() {
        if seen.len() >= MAX_STATES {
            return false;
        }
        if !seen.insert((ip, state.clone())) {
            continue;
        }
        let Some(ins) = graph.instructions.get(&ip) else {
            continue;
        };
        if ins.flow_control() == FlowControl::Return {
            if !state.vals.get(&Loc::Reg(rax)).is_some_and(|v| v.marked) {
                return false;
            }
            continue;
        }
        stack.extend(successors(graph, ins, ip, &state, &mut info));
    }
    true
}
