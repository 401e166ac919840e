//! A method's instructions, decoded one at a time as its paths reach them (its cold
//! part, outside the symbol, included), and shown as the evidence prints them.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use iced_x86::{
    Decoder, DecoderOptions, FlowControl, Formatter, GasFormatter, Instruction,
    InstructionInfoFactory, Mnemonic, OpAccess, Register,
};

use super::end_sites::never_returns;
use super::{gpr, MethodCode};

pub(super) struct Listing<'a, 'c> {
    /// The method's name in the evidence.
    name: &'static str,
    method: MethodCode<'a>,
    /// The code at an address outside the method (a jump's target).
    code_at: &'c dyn Fn(u64) -> Option<MethodCode<'a>>,
    decoded: HashMap<u64, Option<Instruction>>,
}

impl<'a, 'c> Listing<'a, 'c> {
    pub(super) fn new(
        name: &'static str,
        method: MethodCode<'a>,
        code_at: &'c dyn Fn(u64) -> Option<MethodCode<'a>>,
    ) -> Self {
        Listing {
            name,
            method,
            code_at,
            decoded: HashMap::new(),
        }
    }

    pub(super) fn name(&self) -> &'static str {
        self.name
    }

    /// The method's first instruction's address.
    pub(super) fn entry(&self) -> u64 {
        self.method.address
    }

    /// The instruction at `ip`; None where the bytes there are not one.
    pub(super) fn decode(&mut self, ip: u64) -> Option<Instruction> {
        if let Some(ins) = self.decoded.get(&ip) {
            return *ins;
        }
        let code = match self.offset_in_method(ip) {
            Some(from) => Some(MethodCode {
                address: ip,
                bytes: &self.method.bytes[from as usize..],
            }),
            None => (self.code_at)(ip),
        };
        let ins = code.and_then(|c| {
            let mut d = Decoder::with_ip(64, c.bytes, c.address, DecoderOptions::NONE);
            let ins = d.decode();
            (!ins.is_invalid()).then_some(ins)
        });
        self.decoded.insert(ip, ins);
        ins
    }

    /// How far into the method's symbol `ip` is, when it is inside it.
    fn offset_in_method(&self, ip: u64) -> Option<u64> {
        let end = self.method.address + self.method.bytes.len() as u64;
        (self.method.address..end)
            .contains(&ip)
            .then(|| ip - self.method.address)
    }

    /// `method+0xNN: instruction` (the address alone outside the symbol), for an
    /// instruction decoded before.
    pub(super) fn text(&self, ip: u64) -> String {
        let Some(Some(ins)) = self.decoded.get(&ip) else {
            return format!("{ip:#x}");
        };
        let mut f = GasFormatter::new();
        f.options_mut().set_uppercase_hex(false);
        let mut text = String::new();
        f.format(ins, &mut text);
        match self.offset_in_method(ip) {
            Some(off) => format!("{}+{off:#x}: {text}", self.name),
            None => format!("{ip:#x}: {text}"),
        }
    }
}

/// Instructions in all: a bound for unexpected code.
const MAX_INSTRUCTIONS: usize = 20_000;

/// Every instruction a path reaches, with where it goes next.
pub(super) struct Graph {
    pub(super) next: BTreeMap<u64, Vec<u64>>,
    pub(super) previous: BTreeMap<u64, Vec<u64>>,
    pub(super) returns: Vec<u64>,
    /// Where a path ends without returning (a throw, an abort, a trap).
    pub(super) dead_ends: BTreeSet<u64>,
    pub(super) instructions: BTreeMap<u64, Instruction>,
}

impl Graph {
    pub(super) fn walk(
        code: &mut Listing<'_, '_>,
        callee: &dyn Fn(u64) -> Option<String>,
    ) -> Result<Graph, String> {
        let mut graph = Graph {
            next: BTreeMap::new(),
            previous: BTreeMap::new(),
            returns: Vec::new(),
            dead_ends: BTreeSet::new(),
            instructions: BTreeMap::new(),
        };
        let mut stack = vec![code.entry()];
        while let Some(ip) = stack.pop() {
            if graph.next.contains_key(&ip) {
                continue;
            }
            if graph.next.len() >= MAX_INSTRUCTIONS {
                return Err(format!(
                    "{}'s paths reach more than {MAX_INSTRUCTIONS} instructions",
                    code.name()
                ));
            }
            let ins = code
                .decode(ip)
                .ok_or_else(|| format!("the code at {ip:#x} cannot be decoded"))?;
            let after = ins.next_ip();
            let next = match ins.flow_control() {
                FlowControl::Return => {
                    graph.returns.push(ip);
                    vec![]
                }
                FlowControl::UnconditionalBranch => vec![ins.near_branch_target()],
                FlowControl::ConditionalBranch => vec![ins.near_branch_target(), after],
                FlowControl::IndirectBranch => {
                    return Err(format!(
                        "`{}` jumps where it cannot be followed",
                        code.text(ip)
                    ))
                }
                FlowControl::Call
                    if callee(ins.near_branch_target()).is_some_and(|n| never_returns(&n)) =>
                {
                    graph.dead_ends.insert(ip);
                    vec![]
                }
                FlowControl::Exception | FlowControl::Interrupt => {
                    graph.dead_ends.insert(ip);
                    vec![]
                }
                _ => vec![after],
            };
            for to in &next {
                graph.previous.entry(*to).or_default().push(ip);
            }
            stack.extend(next.iter().copied());
            graph.next.insert(ip, next);
            graph.instructions.insert(ip, ins);
        }
        Ok(graph)
    }

    /// The instructions reachable from `from` (included), forward or backward, never
    /// through `skip`.
    pub(super) fn reach(&self, from: &[u64], skip: Option<u64>, forward: bool) -> BTreeSet<u64> {
        let edges = if forward { &self.next } else { &self.previous };
        let mut seen = BTreeSet::new();
        let mut stack: Vec<u64> = from
            .iter()
            .copied()
            .filter(|ip| Some(*ip) != skip)
            .collect();
        while let Some(ip) = stack.pop() {
            if !seen.insert(ip) {
                continue;
            }
            for to in edges.get(&ip).into_iter().flatten() {
                if Some(*to) != skip && !seen.contains(to) {
                    stack.push(*to);
                }
            }
        }
        seen
    }
}

/// What one instruction writes: general-purpose registers (by number), byte ranges of
/// the frame (`[from, to)` from `rbp`), and whether it stores relative to `rsp` (which
/// may land anywhere in the frame; a push or a call's return address goes below it).
pub(super) struct Written {
    pub(super) regs: Vec<usize>,
    pub(super) frame: Vec<(i64, i64)>,
    pub(super) stack: bool,
}

pub(super) fn written(ins: &Instruction, info: &mut InstructionInfoFactory) -> Written {
    let writes = |a: OpAccess| {
        !matches!(
            a,
            OpAccess::Read | OpAccess::CondRead | OpAccess::NoMemAccess | OpAccess::None
        )
    };
    let plain_store = !matches!(ins.mnemonic(), Mnemonic::Push | Mnemonic::Call);
    let info = info.info(ins);
    Written {
        stack: plain_store
            && info
                .used_memory()
                .iter()
                .any(|m| writes(m.access()) && m.base() == Register::RSP),
        regs: info
            .used_registers()
            .iter()
            .filter(|u| writes(u.access()))
            .filter_map(|u| gpr(u.register()))
            .collect(),
        frame: info
            .used_memory()
            .iter()
            .filter(|m| {
                writes(m.access()) && m.base() == Register::RBP && m.index() == Register::None
            })
            .map(|m| {
                let from = m.displacement() as i64;
                (from, from + m.memory_size().size() as i64)
            })
            .collect(),
    }
}
