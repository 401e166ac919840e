//! The labs alone: Dynamo's router and mockers without kvscope, the NIXL lab's scenarios and
//! its migration data plane.

mod lab_alone;
mod nixl_lab;
mod nixl_serve;
