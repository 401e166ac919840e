//! Where `postXferReq` holds its final status, read from its instructions, so that a
//! build no table holds sees each post return at one instruction (a jump, which x86
//! uprobes emulate: one trap) instead of by a return probe (a trap at the entry to
//! plant it and another at the return).
//!
//! The method's paths are followed from its first instruction into its cold part,
//! ending at its returns and at calls that never return. The status every return gives
//! is where the last write to `eax` before it reads it: a callee-saved register (1.0 to
//! 1.4 keep it in `r12`/`r14`), or a slot of the frame `rbp` points to (1.5); the same
//! on every path. The site is the first jump that
//! - every path from the entry to a return runs through, and no loop runs again (so it
//!   runs once per post that returns);
//! - leads only to returns (no throw or abort past it);
//! - comes before every read of the status into `eax`, after which the register or slot
//!   is never written: for a slot, `rbp` stays the frame, its address is never taken
//!   (no call can write it) and nothing is stored relative to `rsp`.

use std::collections::BTreeSet;

use iced_x86::{FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpKind, Register};

use super::listing::{written, Graph, Listing};
use super::{gpr, site_gpr, site_reg, MethodCode};
use crate::nixl::offsets::SiteValue;

/// Where a post's status is final, as a virtual address, and where it is there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PostSite {
    pub at: u64,
    /// A callee-saved register, or a slot below the frame pointer.
    pub status: SiteValue,
    /// The instructions that placed it.
    pub evidence: Vec<String>,
}

/// Where one return's status comes from: the last write to `eax` before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    At(SiteValue),
    /// Anything else (a constant, a call's result, arithmetic): at this instruction.
    Other(u64),
}

fn writes_rax(ins: &Instruction, info: &mut InstructionInfoFactory) -> bool {
    matches!(
        ins.flow_control(),
        FlowControl::Call | FlowControl::IndirectCall
    ) || writes_gpr(ins, info, Register::RAX)
}

fn writes_gpr(ins: &Instruction, info: &mut InstructionInfoFactory, r: Register) -> bool {
    gpr(r).is_some_and(|g| written(ins, info).regs.contains(&g))
}

/// `mov <callee-saved register or frame slot>,%eax`: where it reads.
fn source_of(ins: &Instruction, ip: u64) -> Source {
    if ins.mnemonic() != Mnemonic::Mov
        || ins.op0_kind() != OpKind::Register
        || gpr(ins.op0_register()) != gpr(Register::RAX)
    {
        return Source::Other(ip);
    }
    match ins.op1_kind() {
        OpKind::Register => match gpr(ins.op1_register()).and_then(site_reg) {
            Some(r) => Source::At(SiteValue::Reg(r)),
            None => Source::Other(ip),
        },
        OpKind::Memory
            if ins.memory_base() == Register::RBP && ins.memory_index() == Register::None =>
        {
            let below = (ins.memory_displacement64() as i64).checked_neg();
            match below.and_then(|b| u32::try_from(b).ok()).filter(|b| *b > 0) {
                Some(below) => Source::At(SiteValue::Frame(below)),
                None => Source::Other(ip),
            }
        }
        _ => Source::Other(ip),
    }
}

/// Where `post` (`postXferReq`) holds its final status on every return; `code_at` gives
/// the code its jumps lead to, `callee` names a call's target.
pub fn post_site<'a>(
    post: MethodCode<'a>,
    code_at: &dyn Fn(u64) -> Option<MethodCode<'a>>,
    callee: &dyn Fn(u64) -> Option<String>,
) -> Result<PostSite, String> {
    let mut code = Listing::new("postXferReq", post, code_at);
    let graph = Graph::walk(&mut code, callee)?;
    let mut info = InstructionInfoFactory::new();
    if graph.returns.is_empty() {
        return Err("postXferReq never returns".into());
    }
    // Each return's status: the writes to eax met walking back from it.
    let mut writers = BTreeSet::new();
    for ret in &graph.returns {
        let mut seen = BTreeSet::new();
        let mut stack: Vec<u64> = graph.previous.get(ret).cloned().unwrap_or_default();
        if stack.is_empty() {
            return Err(format!(
                "`{}` returns a status never written",
                code.text(*ret)
            ));
        }
        while let Some(ip) = stack.pop() {
            if !seen.insert(ip) {
                continue;
            }
            let ins = graph.instructions[&ip];
            if writes_rax(&ins, &mut info) {
                writers.insert(ip);
                continue;
            }
            match graph.previous.get(&ip) {
                Some(from) => stack.extend(from.iter().copied()),
                None => {
                    return Err(format!(
                        "`{}` returns a status no instruction on its path writes",
                        code.text(*ret)
                    ))
                }
            }
        }
    }
    let sources: Vec<Source> = writers
        .iter()
        .map(|ip| source_of(&graph.instructions[ip], *ip))
        .collect();
    let status = match sources.as_slice() {
        [Source::At(first), rest @ ..] if rest.iter().all(|s| *s == Source::At(*first)) => *first,
        _ => {
            return Err(format!(
                "its returns' status is not in one callee-saved register or frame slot on \
                 every path: {}",
                writers
                    .iter()
                    .map(|ip| format!("`{}`", code.text(*ip)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        }
    };
    let writes_status = |ins: &Instruction, info: &mut InstructionInfoFactory| match status {
        SiteValue::Reg(r) => site_gpr(r).is_none_or(|g| written(ins, info).regs.contains(&g)),
        SiteValue::Frame(below) => {
            let slot = -i64::from(below);
            let w = written(ins, info);
            w.stack
                || w.frame
                    .iter()
                    .any(|(from, to)| *from < slot + 4 && slot < *to)
        }
        _ => true,
    };
    // Every instruction on a path to a read of the status into eax.
    let before_reads = graph.reach(&writers.iter().copied().collect::<Vec<_>>(), None, false);
    // A frame slot: `rbp` is the frame from the prologue on, wherever the status is
    // read, and the slot's address is never taken.
    if let SiteValue::Frame(below) = status {
        let entry = code.entry();
        let prologue = graph.instructions.get(&entry).map(Instruction::mnemonic)
            == Some(Mnemonic::Push)
            && graph.instructions[&entry].op0_register() == Register::RBP;
        let set_at = graph.next.get(&entry).and_then(|n| n.first().copied());
        let sets_frame = set_at
            .and_then(|ip| graph.instructions.get(&ip))
            .is_some_and(|i| {
                i.mnemonic() == Mnemonic::Mov
                    && i.op0_register() == Register::RBP
                    && i.op1_register() == Register::RSP
            });
        if !prologue || !sets_frame {
            return Err(format!(
                "the status is in a frame slot ({}), but the method does not begin by \
                 setting its frame pointer",
                code.text(*writers.first().unwrap_or(&entry))
            ));
        }
        for (ip, ins) in &graph.instructions {
            let moves_rbp = Some(*ip) != set_at
                && before_reads.contains(ip)
                && writes_gpr(ins, &mut info, Register::RBP);
            let takes_slot = (ins.mnemonic() == Mnemonic::Lea
                && ins.memory_base() == Register::RBP
                && (ins.memory_displacement64() as i64) <= -i64::from(below))
                || (ins.op_count() > 1
                    && ins.op1_kind() == OpKind::Register
                    && ins.op1_register() == Register::RBP
                    && Some(*ip) != set_at);
            if moves_rbp || takes_slot {
                return Err(format!(
                    "the status's frame slot (-{below:#x}(%rbp)) may change unseen: `{}`",
                    code.text(*ip)
                ));
            }
        }
    }
    // The candidates: jumps every return runs through, once, with only returns past
    // them and the status final; the earliest (every other is reachable from it).
    let entry = code.entry();
    let mut best: Option<(usize, u64)> = None;
    for (ip, ins) in &graph.instructions {
        if !matches!(
            ins.flow_control(),
            FlowControl::ConditionalBranch | FlowControl::UnconditionalBranch
        ) {
            continue;
        }
        let without = graph.reach(&[entry], Some(*ip), true);
        if graph.returns.iter().any(|r| without.contains(r)) {
            continue; // a return some path reaches around it
        }
        let onward = graph.next.get(ip).cloned().unwrap_or_default();
        let after = graph.reach(&onward, None, true);
        if after.contains(ip) || !after.is_disjoint(&graph.dead_ends) {
            continue; // in a loop, or a throw past it
        }
        if !writers.iter().all(|w| after.contains(w))
            || after
                .intersection(&before_reads)
                .any(|a| writes_status(&graph.instructions[a], &mut info))
        {
            continue;
        }
        if best.is_none_or(|(n, _)| after.len() > n) {
            best = Some((after.len(), *ip));
        }
    }
    let Some((_, at)) = best else {
        return Err(format!(
            "no jump that every return runs through once comes before its status is read \
             ({}) with the status final",
            writers
                .iter()
                .map(|ip| format!("`{}`", code.text(*ip)))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    };
    let mut evidence = vec![format!("post returned: {}", code.text(at))];
    evidence.extend(
        writers
            .iter()
            .map(|ip| format!("status: {}", code.text(*ip))),
    );
    Ok(PostSite {
        at,
        status,
        evidence,
    })
}
